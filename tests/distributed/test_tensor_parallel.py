"""Tensor parallelism over two gloo workers on CPU: greedy output identical, token for token,
to one worker (tiny fp32 Llama, Qwen3, tied Qwen2, Qwen3-MoE), through ``LLM(model=DIR, nnodes=2)`` spawning
the second worker; each worker holds only its shard of the weights and half the KV heads
(the plan's per-worker layout); every worker process is gone after shutdown."""

from __future__ import annotations

import pytest

from tests.distributed.conftest import BASE, alive
from tests.engine.checkpoints import qwen2_checkpoint, qwen3_moe_checkpoint
from xllm_vmm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(40, 75))]  # 35: over 2 blocks


def generate(model, **flags) -> tuple[list[list[int]], dict]:
    llm = LLM(model=str(model), **BASE, **flags)
    eng = llm.llm_engine
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
        info = {"pids": [s["pid"] for s in eng.distributed.worker_stats()] if eng.distributed else [],
                "stats": eng.distributed.worker_stats() if eng.distributed else [],
                "q_rows": eng.weights["model.layers.0.self_attn.q_proj.weight"].shape[0],
                "embed_rows": eng.weights["model.embed_tokens.weight"].shape[0],
                "kv_width": eng.plan.layout.groups[0].tensors[0].bytes_per_token,
                "dist": eng.stats().get("distributed")}
        return [list(o.outputs[0].token_ids) for o in outs], info
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2-tied", "qwen3-moe"])
def test_two_workers_equal_one_token_for_token(family, llama_dir, qwen3_dir, tmp_path_factory):
    if family == "qwen2-tied":  # the head reads the embedding's own shard; q/k/v biases split
        model = qwen2_checkpoint(tmp_path_factory.mktemp("tp-qwen2"))
    elif family == "qwen3-moe":  # every expert's intermediate features split
        model = qwen3_moe_checkpoint(tmp_path_factory.mktemp("tp-moe"))
    else:
        model = {"llama": llama_dir, "qwen3": qwen3_dir}[family]
    one, info1 = generate(model)
    two, info2 = generate(model, nnodes=2)
    assert two == one
    assert all(len(t) == GREEDY.max_tokens for t in two)
    # each worker loads its shard only; the cache holds this worker's KV heads (plan layout)
    assert info2["q_rows"] * 2 == info1["q_rows"]
    assert info2["embed_rows"] * 2 == info1["embed_rows"]
    assert info2["kv_width"] * 2 == info1["kv_width"]
    ranks = [s["rank"] for s in info2["stats"]]
    assert ranks == [0, 1]
    # the same slots are mapped on both workers (one block-table space)
    kv = [s["kv_mapped_bytes"] for s in info2["stats"]]
    assert kv[0] == kv[1] > 0
    assert not alive(info2["pids"][1])
    # the benchmark's figures: two all-reduces per layer, the embedding's one
    d = info2["dist"]
    assert info1["dist"] is None and d["world_size"] == 2 and d["steps"] > 0
    assert d["all_reduce_calls_per_step"] == 2 * 2 + 1  # 2 layers (attention + MLP/MoE) + embedding
    assert d["all_reduce_seconds_per_step"] > 0 and d["all_reduce_bytes_per_step"] > 0


def test_several_devices_in_one_command_spawn_one_worker_each(llama_dir):
    one, _ = generate(llama_dir)
    two, info = generate(llama_dir, devices="cpu:0,cpu:1")  # nnodes=1: rank 0 spawns rank 1
    assert two == one and [s["rank"] for s in info["stats"]] == [0, 1]
    assert not alive(info["pids"][1])


def test_world_size_one_has_no_runtime(llama_dir):
    llm = LLM(model=str(llama_dir), **BASE)
    try:
        assert llm.llm_engine.distributed is None
        assert type(llm.llm_engine.worker).__name__ == "Worker"
    finally:
        llm.llm_engine.shutdown()


def test_prefix_hits_and_chunked_prefill_equal_one_worker(llama_dir):
    # an elastic pool, prefix cache on, prefill in chunks of 32 tokens: cached blocks are hit
    # by later prompts and evicted on every worker through the same slot calls
    flags = dict(enable_vmm_kvcache=True, vmm_elastic=True, enable_prefix_cache=True,
                 max_tokens_per_batch=32, enable_chunked_prefill=True)
    shared = list(range(100, 148))  # three full blocks shared by every prompt
    prompts = [shared + [5 + i, 9, 13 + i] for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def run(**extra):
        llm = LLM(model=str(llama_dir), **BASE, **flags, **extra)
        try:
            first = llm.generate([{"prompt_token_ids": prompts[0]}], sp)
            rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], sp)
            hits = llm.llm_engine.stats()["prefix_cache_hits"]
            return [list(o.outputs[0].token_ids) for o in first + rest], hits
        finally:
            llm.llm_engine.shutdown()

    one, hits1 = run()
    two, hits2 = run(nnodes=2)
    assert two == one
    assert hits2 == hits1 > 0


def test_four_workers_replicate_the_two_kv_heads(llama_dir):
    # 4 workers, 2 KV heads: each worker caches one head (held by two workers), as the
    # plan's per-worker layout says; the output still equals one worker's
    one, info1 = generate(llama_dir)
    four, info4 = generate(llama_dir, nnodes=4)
    assert four == one
    assert info4["kv_width"] * 2 == info1["kv_width"]  # one of two heads, not a quarter
    assert info4["q_rows"] * 4 == info1["q_rows"]
    assert [s["rank"] for s in info4["stats"]] == [0, 1, 2, 3]
    assert not any(alive(p) for p in info4["pids"][1:])
