"""The shard hook (what each worker loads) and the start-up refusals — no processes."""

from __future__ import annotations

import pytest

from tests.distributed.conftest import BASE
from xllm_vmm.config import ConfigError
from xllm_vmm.engine.distributed.sharding import check_divisible, held_shape, kv_head_range, shard_hook
from xllm_vmm.engine.distributed.topology import parse_master_addr
from xllm_vmm.engine.llm_engine import LLMEngine
from xllm_vmm.engine.models.config import ModelConfig
from xllm_vmm.models.errors import LayoutError

CFG = ModelConfig.from_dict({
    "architectures": ["LlamaForCausalLM"], "vocab_size": 384, "hidden_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 128, "head_dim": 16})


def test_rows_and_columns_per_rank():
    h0, h1 = shard_hook(CFG, 0, 2), shard_hook(CFG, 1, 2)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert h0(q, (64, 64)).__dict__ == {"dim": 0, "start": 0, "stop": 32}
    assert h1(q, (64, 64)).__dict__ == {"dim": 0, "start": 32, "stop": 64}
    assert h1("model.layers.1.self_attn.o_proj.weight", (64, 64)).__dict__ == {
        "dim": 1, "start": 32, "stop": 64}
    assert h1("model.layers.0.self_attn.k_proj.weight", (32, 64)).__dict__ == {
        "dim": 0, "start": 16, "stop": 32}
    assert h1("model.layers.0.mlp.down_proj.weight", (64, 128)).__dict__ == {
        "dim": 1, "start": 64, "stop": 128}
    moe = ModelConfig.from_dict({**CFG.raw, "architectures": ["Qwen3MoeForCausalLM"],
                                 "num_experts": 4, "moe_intermediate_size": 128})
    assert shard_hook(moe, 1, 2)("model.layers.0.mlp.experts.3.up_proj.weight",
                                 (128, 64)).__dict__ == {"dim": 0, "start": 64, "stop": 128}
    assert h1("lm_head.weight", (384, 64)).__dict__ == {"dim": 0, "start": 192, "stop": 384}
    for whole in ("model.norm.weight", "model.layers.0.input_layernorm.weight",
                  "model.layers.0.self_attn.o_proj.bias", "model.layers.0.mlp.gate.weight",
                  "model.layers.0.self_attn.q_norm.weight"):
        assert h0(whole, (64,)) is None
    assert held_shape(h0, q, (64, 64)) == (32, 64)


MOE = ModelConfig.from_dict({**CFG.raw, "architectures": ["Qwen3MoeForCausalLM"],
                             "num_experts": 8, "moe_intermediate_size": 32})


@pytest.mark.parametrize("world, ep", [(2, 1), (2, 2), (4, 2), (4, 4)])
def test_expert_parallel_groups_hold_each_expert_slice_once(world, ep):
    # every (expert, intermediate feature) is loaded by exactly one worker; the rest skip it
    held: dict[tuple[int, int], int] = {}
    for r in range(world):
        h = shard_hook(MOE, r, world, ep)
        for j in range(8):
            spec = h(f"model.layers.0.mlp.experts.{j}.gate_proj.weight", (32, 64))
            down = h(f"model.layers.0.mlp.experts.{j}.down_proj.weight", (64, 32))
            assert spec.skipped == down.skipped
            if spec.skipped:
                continue
            assert (down.dim, down.start, down.stop) == (1, spec.start, spec.stop)
            for f in range(spec.start, spec.stop):
                held[(j, f)] = held.get((j, f), 0) + 1
        assert sum(not h(f"model.layers.0.mlp.experts.{j}.up_proj.weight", (32, 64)).skipped
                   for j in range(8)) == 8 // ep  # a worker holds its group's experts only
    assert held == {(j, f): 1 for j in range(8) for f in range(32)}


def test_expert_parallel_refusals_name_the_field():
    with pytest.raises(LayoutError, match="3 expert-parallel groups cannot split num_experts=8"):
        check_divisible(ModelConfig.from_dict({**MOE.raw, "num_attention_heads": 12}), 6, 3)
    with pytest.raises(LayoutError, match="has no routed experts"):
        check_divisible(CFG, 2, 2)


def test_kv_heads_replicated_when_workers_exceed_them():
    # 4 workers, 2 KV heads: each head on two workers, as the cache layout counts it
    assert [kv_head_range(2, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    h3 = shard_hook(CFG, 3, 4)
    assert h3("model.layers.0.self_attn.v_proj.weight", (32, 64)).__dict__ == {
        "dim": 0, "start": 16, "stop": 32}


def test_indivisible_worker_counts_name_the_field():
    with pytest.raises(LayoutError, match="num_attention_heads=4"):
        check_divisible(CFG, 3)
    tiny = ModelConfig.from_dict({**CFG.raw, "vocab_size": 5})
    with pytest.raises(LayoutError, match="cannot split vocab_size=5: with 2 rows per worker "
                                          "the last holds none"):
        check_divisible(tiny, 4)


@pytest.mark.parametrize("vocab, world", [(385, 2), (387, 4), (384, 4), (5, 2)])
def test_a_vocabulary_the_workers_do_not_divide_is_padded(vocab, world):
    # ceil(V / W) rows per worker, the last the rest: the ranges tile [0, V) exactly
    odd = ModelConfig.from_dict({**CFG.raw, "vocab_size": vocab})
    check_divisible(odd, world)
    part = -(-vocab // world)
    specs = [shard_hook(odd, r, world)("model.embed_tokens.weight", (vocab, 64))
             for r in range(world)]
    assert [(s.start, s.stop) for s in specs] == [
        (r * part, min((r + 1) * part, vocab)) for r in range(world)]
    assert specs[-1].stop == vocab and all(s.stop > s.start for s in specs)


def test_linear_attention_heads_must_divide():
    nxt = ModelConfig.from_dict({**CFG.raw, "architectures": ["Qwen3NextForCausalLM"],
                                 "linear_num_key_heads": 2, "linear_num_value_heads": 4})
    check_divisible(nxt, 2)
    with pytest.raises(LayoutError, match="cannot split linear_num_key_heads=2"):
        check_divisible(nxt, 4)
    h1 = shard_hook(nxt, 1, 2)
    assert h1("model.layers.0.linear_attn.in_proj_qkvz.weight", (96, 64)).__dict__ == {
        "dim": 0, "start": 48, "stop": 96}
    assert h1("model.layers.0.linear_attn.A_log", (4,)).__dict__ == {
        "dim": 0, "start": 2, "stop": 4}
    assert h1("model.layers.0.linear_attn.out_proj.weight", (64, 32)).__dict__ == {
        "dim": 1, "start": 16, "stop": 32}
    assert h1("model.layers.0.linear_attn.conv1d.weight", (64, 1, 4)) is None  # whole


def test_master_addr_parsing():
    assert parse_master_addr("127.0.0.1:19888") == ("127.0.0.1", 19888)
    assert parse_master_addr("[::1]:5") == ("::1", 5)
    for bad in ("127.0.0.1", ":80", "host:0", "host:x", ""):
        with pytest.raises(ValueError, match="master_node_addr"):
            parse_master_addr(bad)


@pytest.mark.parametrize("flags, names", [
    ({"nnodes": 2, "dp_size": 2}, "dp_size"),
    ({"nnodes": 2, "ep_size": 2}, "ep_size"),
    ({"nnodes": 2, "num_speculative_tokens": 1}, "num_speculative_tokens"),
    ({"nnodes": 2, "master_node_addr": "nowhere"}, "master_node_addr"),
    ({"nnodes": 3}, "attention heads"),
    ({"nnodes": 2, "worker_device_memory": ["64MiB"]}, "worker_device_memory"),
    ({"nnodes": 2, "devices": "cpu:0,cpu:1"}, "one device"),
])
def test_refused_at_start_up_before_any_worker_starts(llama_dir, flags, names):
    with pytest.raises(ConfigError) as e:
        LLMEngine.from_flags(str(llama_dir), **{**BASE, **flags})
    assert names in str(e.value)
