"""DeepSeek-V3 (MLA + MoE with shared experts + a dense first layer) on the MLA cache layout:
logits and greedy tokens equal ``transformers.DeepseekV3ForCausalLM`` on a tiny fp32
checkpoint, over the real KV cache manager and scheduler, with and without VMM, with chunked
prefill and prefix-cache hits; the latents live in the arena's ``"mla"`` group."""

from __future__ import annotations

import pytest
import torch

from tests.engine import checkpoints as C
from tests.engine.managed_stack import ManagedStack
from xllm_vmm.engine.step import SeqChunk, StepInput

BS = 16
ATOL = 2e-4


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    d = C.deepseek_v3_checkpoint(tmp_path_factory.mktemp("dsv3") / "m")
    return d, C.load_hf_model(d)


_prompt = C.random_prompt


_hf_last_logits = C.hf_last_logits


def _prefill(stack, ids, rid="x"):
    tab = stack.mgr.allocate(rid, len(ids), num_prompt_tokens=len(ids))
    out = stack.worker.execute(StepInput.build([SeqChunk(rid, ids, 0, tab, True)], BS))
    return out, tab


@pytest.fixture
def stack(ds):
    s = ManagedStack(ds[0], block_size=BS)
    yield s
    s.close()


def test_layout_is_the_latent_group(ds, stack):
    assert [g.name for g in stack.layout.groups] == ["mla"]
    g = stack.layout.group("mla")
    assert [t.name for t in g.tensors] == ["layer0.latent", "layer1.latent"]
    assert g.tensor_bytes_per_token == (32 + 8) * 4  # (kv_lora_rank + rope) fp32
    assert stack.worker.model.unused_weights == []


@pytest.mark.parametrize("n", [1, BS - 1, BS + 1, 3 * BS + 5])
def test_prefill_logits_match_hf(ds, stack, n):
    ids = _prompt(n)
    out, _ = _prefill(stack, ids)
    torch.testing.assert_close(out.logits[0], _hf_last_logits(ds[1], ids), atol=ATOL, rtol=0)


def test_latent_cache_holds_hf_compressed_kv_and_rope_key(ds, stack):
    ids = _prompt(2 * BS + 3, 1)
    _, tab = _prefill(stack, ids)
    with torch.no_grad():
        cache = ds[1](torch.tensor([ids]), use_cache=True).past_key_values
    views = stack.worker.kv_views
    bps = views.geometry.blocks_per_slot
    for layer in range(2):
        got = torch.cat([views.layers[layer].blocks[b // bps, b % bps] for b in tab["mla"]])
        got = got[:len(ids)]
        c = cache.layers[layer].keys[0, 0]  # (L, kv_lora_rank): normed compressed KV
        k_rope = cache.layers[layer].values[0, 0]  # (L, rope): rotated shared key
        torch.testing.assert_close(got[:, :32], c, atol=1e-5, rtol=0)
        torch.testing.assert_close(got[:, 32:], k_rope, atol=1e-5, rtol=0)
    geo = stack.mgr.cache.geometry["mla"]
    b = tab["mla"][0]
    assert views.layers[1].blocks[b // bps, b % bps].data_ptr() == geo.block_va(1, b)


@pytest.mark.parametrize("vmm", [True, False], ids=["vmm", "physical"])
def test_batched_greedy_matches_hf_generate(ds, vmm):
    s = ManagedStack(ds[0], block_size=BS, vmm=vmm)
    try:
        prompts = {f"r{n}": _prompt(n, 2) for n in (1, 9, BS, 2 * BS + 7)}
        got = s.generate(prompts, 10)
    finally:
        s.close()
    for r, ids in prompts.items():
        assert got[r] == C.hf_greedy(ds[1], ids, 10), r


def test_chunked_prefill_matches_hf(ds):
    s = ManagedStack(ds[0], block_size=BS, max_batch_tokens=11)
    try:
        prompts = {"a": _prompt(45, 3), "b": _prompt(30, 3)}
        got = s.generate(prompts, 8)
        chunked = [c for st in s.steps for c in st.chunks if len(c.token_ids) > 1 and c.start_pos]
    finally:
        s.close()
    assert chunked, "the prompts were not prefilled in chunks"
    for r, ids in prompts.items():
        assert got[r] == C.hf_greedy(ds[1], ids, 8), r


def test_prefix_hits_reuse_latent_blocks(ds):
    s = ManagedStack(ds[0], block_size=BS, prefix=True)
    try:
        base = _prompt(3 * BS + 2, 4)
        first = s.generate({"a": base}, 6)["a"]
        other = base[:2 * BS + 5] + _prompt(9, 5)
        second = s.generate({"b": other}, 6)["b"]
        starts = [c.start_pos for st in s.steps for c in st.chunks if c.request_id == "b"]
        hits = s.mgr.stats()
    finally:
        s.close()
    assert starts[0] == 2 * BS, (starts, hits)  # two whole blocks came from the prefix cache
    assert first == C.hf_greedy(ds[1], base, 6)
    assert second == C.hf_greedy(ds[1], other, 6)


def test_q_without_lora_and_untied_head(tmp_path):
    d = C.deepseek_v3_checkpoint(tmp_path / "m", q_lora_rank=None, first_k_dense_replace=2)
    hf = C.load_hf_model(d)
    s = ManagedStack(d, block_size=BS)
    try:
        ids = _prompt(21, 6)
        out, _ = _prefill(s, ids)
        assert s.worker.model.layers[0].attn.q_proj is not None
        torch.testing.assert_close(out.logits[0], _hf_last_logits(hf, ids), atol=ATOL, rtol=0)
    finally:
        s.close()


def test_router_matches_hf_with_correction_bias(ds, stack):
    """Grouped sigmoid routing: the same experts and weights as DeepseekV3TopkRouter."""
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(7))
    hf_gate = ds[1].model.layers[1].mlp.gate
    assert hf_gate.e_score_correction_bias.abs().sum() > 0
    with torch.no_grad():
        _, w_ref, i_ref = hf_gate(x)
    w, i = stack.worker.model.layers[1].mlp.route(x)
    o_ref, o = i_ref.sort(-1), i.sort(-1)
    assert torch.equal(o_ref.values, o.values)
    torch.testing.assert_close(w.gather(1, o.indices), w_ref.gather(1, o_ref.indices))
    with torch.no_grad():
        torch.testing.assert_close(stack.worker.model.layers[1].mlp(x),
                                   ds[1].model.layers[1].mlp(x), atol=1e-4, rtol=0)


def test_latent_views_refuse_another_layout(ds, tmp_path):
    from xllm_vmm.engine.attention.kv import KVLayoutMismatch
    from xllm_vmm.engine.worker import Worker

    llama = ManagedStack(C.llama_checkpoint(tmp_path / "llama"), block_size=BS)
    try:
        with pytest.raises(KVLayoutMismatch, match="no group 'mla'.*kv_lora_rank"):
            Worker.create(ds[0], pool=llama.pool, kv_cache=llama.mgr.cache)
    finally:
        llama.close()


def test_llm_generate_runs_deepseek_v3(ds):
    """Through the public API: plan sizes the MLA layout, the engine runs it."""
    from xllm_vmm import LLM, SamplingParams

    llm = LLM(model=str(ds[0]))
    try:
        prompts = [_prompt(20, 9), _prompt(37, 9)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        groups = llm.llm_engine.kv_cache_manager.group_names
        # plan's layout is the running cache's (one latent tensor per layer, its widths)
        assert llm.llm_engine.plan.layout == llm.llm_engine.kv_cache_manager.cache.layout
    finally:
        llm.llm_engine.shutdown()
    assert groups == ("mla",)
    for p, o in zip(prompts, outs):
        assert list(o.outputs[0].token_ids) == C.hf_greedy(ds[1], p, 6)


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.5}


def test_yarn_rope_matches_hf(tmp_path):
    """DeepSeek-V3's released configs use YaRN: scaled frequencies, cos/sin times the
    attention factor, the softmax scale times mscale(mscale_all_dim)^2 — prompts past the
    original context give the same logits and greedy tokens as transformers."""
    d = C.deepseek_v3_checkpoint(tmp_path / "m", rope_scaling=YARN)
    hf = C.load_hf_model(d)
    s = ManagedStack(d, block_size=BS)
    try:
        ids = _prompt(50, 7)
        out, _ = _prefill(s, ids)
        assert s.worker.model.rotary.attention_factor != 1.0
        torch.testing.assert_close(out.logits[0], _hf_last_logits(hf, ids), atol=ATOL, rtol=0)
        s.mgr.free("x")
        assert s.generate({"g": ids}, 5)["g"] == C.hf_greedy(hf, ids, 5)
    finally:
        s.close()


@pytest.fixture(scope="module")
def ds32(tmp_path_factory):
    d = C.deepseek_v32_checkpoint(tmp_path_factory.mktemp("dsv32") / "m")
    return d, C.load_hf_model(d)


def test_v32_layout_has_the_index_group(ds32):
    s = ManagedStack(ds32[0], block_size=BS)
    try:
        assert [g.name for g in s.layout.groups] == ["mla", "index"]
        assert s.layout.group("index").tensor_bytes_per_token == 16 * 4
        assert s.worker.model.unused_weights == []
        # more tokens than index_topk (8): the indexer's selection decides what is attended
        for n in (5, 20, 37):
            ids = _prompt(n, 10)
            out, tab = _prefill(s, ids, rid=f"x{n}")
            torch.testing.assert_close(out.logits[0], _hf_last_logits(ds32[1], ids), atol=ATOL,
                                       rtol=0)
        assert tab["index"] and len(tab["index"]) == len(tab["mla"])
    finally:
        s.close()


def test_v32_greedy_with_chunked_prefill_and_prefix_hits(ds32):
    s = ManagedStack(ds32[0], block_size=BS, prefix=True, max_batch_tokens=11)
    try:
        base = _prompt(2 * BS + 6, 11)
        first = s.generate({"a": base}, 6)["a"]
        other = base[:2 * BS + 1] + _prompt(5, 12)
        second = s.generate({"b": other}, 6)["b"]
        starts = [c.start_pos for st in s.steps for c in st.chunks if c.request_id == "b"]
    finally:
        s.close()
    assert starts[0] == 2 * BS
    assert first == C.hf_greedy(ds32[1], base, 6)
    assert second == C.hf_greedy(ds32[1], other, 6)


@pytest.mark.parametrize("which", ["ds", "ds32"])
def test_host_tier_carries_latent_and_index_blocks(which, request):
    """Cached blocks go to the host tier when the cache sleeps (MLA: the latents; MLA+INDEX:
    the index keys too); after wake-up a prompt sharing two blocks is served from the host tier
    (restored into fresh device blocks) with transformers' tokens."""
    d, hf = request.getfixturevalue(which)
    s = ManagedStack(d, block_size=BS, prefix=True, host_blocks_factor=2.0)
    try:
        base = _prompt(2 * BS + 6, 13)
        first = s.generate({"a": base}, 4)["a"]
        assert s.mgr.sleep(offload=True) > 0
        s.mgr.wake_up()
        other = base[:2 * BS + 1] + _prompt(5, 14)
        second = s.generate({"b": other}, 4)["b"]
        st = s.mgr.stats()
    finally:
        s.close()
    assert st["host_offloaded_blocks"] == 2 and st["host_restored_blocks"] == 2
    assert first == C.hf_greedy(hf, base, 4)
    assert second == C.hf_greedy(hf, other, 4)
