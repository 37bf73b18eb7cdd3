"""Expert parallelism (``ep_size``) and MLA tensor parallelism over gloo workers on CPU: greedy
output token for token equal to one worker.

- Qwen3-MoE with ``ep_size`` 2 and 4: each worker loads only its expert group's experts (the
  shard hook skips the others), each expert's features split ``W / ep`` ways; the layer's
  all-reduce combines them;
- DeepSeek-V3 (MLA, a dense first layer, routed + shared experts) and DeepSeek-V3.2 (its
  indexer, replicated): attention heads split, the latent (and index-key) cache replicated per
  worker as the plan's layout says — the running cache's per-worker figures equal the plan's."""

from __future__ import annotations

import pytest

from tests.distributed.conftest import BASE, alive
from tests.engine.checkpoints import (deepseek_v3_checkpoint, deepseek_v32_checkpoint,
                                      qwen3_moe_checkpoint)
from xllm_vmm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(40, 75))]  # 35: over 2 blocks


def generate(model, **flags) -> tuple[list[list[int]], dict]:
    llm = LLM(model=str(model), **BASE, **flags)
    eng = llm.llm_engine
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
        cache = eng.kv_cache_manager.cache
        info = {"pids": [s["pid"] for s in eng.distributed.worker_stats()] if eng.distributed else [],
                "names": set(eng.weights.keys()) if hasattr(eng.weights, "keys") else set(),
                "stats": eng.distributed.worker_stats() if eng.distributed else [],
                "plan": [(g.name, [t.bytes_per_token for t in g.tensors])
                         for g in eng.plan.layout.groups],
                "cache": {g: v.num_slots for g, v in cache.geometry.items()},
                "plan_workers": eng.plan.layout.workers}
        return [list(o.outputs[0].token_ids) for o in outs], info
    finally:
        eng.shutdown()


def experts_held(names: set[str], layer: int = 0) -> list[int]:
    return sorted({int(n.split(".experts.")[1].split(".")[0]) for n in names
                   if f"layers.{layer}.mlp.experts." in n})


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return qwen3_moe_checkpoint(tmp_path_factory.mktemp("ep-moe"))


@pytest.fixture(scope="module")
def moe_one(moe_dir):
    return generate(moe_dir)


@pytest.mark.parametrize("world, ep", [(2, 2), (4, 2), (4, 4)])
def test_expert_parallel_equals_one_worker(moe_dir, moe_one, world, ep):
    one, info1 = moe_one
    many, info = generate(moe_dir, nnodes=world, ep_size=ep)
    assert many == one
    assert all(len(t) == GREEDY.max_tokens for t in many)
    assert experts_held(info1["names"]) == list(range(8))
    assert experts_held(info["names"]) == list(range(8 // ep))  # rank 0: its group's experts
    assert [s["rank"] for s in info["stats"]] == list(range(world))
    assert not any(alive(p) for p in info["pids"][1:])


@pytest.mark.parametrize("family, flags", [
    ("deepseek_v3", {"nnodes": 2}), ("deepseek_v3", {"nnodes": 2, "ep_size": 2}),
    ("deepseek_v3", {"nnodes": 4, "ep_size": 2}), ("deepseek_v32", {"nnodes": 2})])
def test_mla_heads_split_latent_replicated_equals_one_worker(family, flags, tmp_path_factory):
    build = {"deepseek_v3": deepseek_v3_checkpoint, "deepseek_v32": deepseek_v32_checkpoint}
    model = build[family](tmp_path_factory.mktemp(f"tp-{family}"))
    one, info1 = generate(model)
    many, info = generate(model, **flags)
    assert many == one
    assert info["plan_workers"] == flags["nnodes"]
    # MLA: the latent (and index-key) tensors are replicated — every worker caches the full
    # per-token width, as the plan's per-worker layout says; the running cache has the plan's
    # groups and slots
    assert info["plan"] == info1["plan"]
    assert set(info["cache"]) == {name for name, _ in info["plan"]}
    kv = [s["kv_mapped_bytes"] for s in info["stats"]]
    assert len(set(kv)) == 1 and kv[0] > 0  # the same slots mapped on every worker
    q_rows = [n for n in info["names"] if n.endswith("layers.0.self_attn.q_b_proj.weight")]
    assert q_rows  # (the q LoRA checkpoint)
    assert not any(alive(p) for p in info["pids"][1:])
