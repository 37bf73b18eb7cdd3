"""Hybrid tensor parallelism (Qwen3-Next) over two gloo workers on CPU: the Gated DeltaNet
layers split their key heads (with their value heads), conv channels and ``out_proj``; the
gated full attention splits heads as the other families; the resident conv/recurrent state
is per worker shard — its bytes per sequence equal the plan's per-worker figure. Greedy
output token for token equal to one worker (experts split by features, or by ``ep_size``).
The prefix cache (linear-state checkpoints, one shard per worker) is refused across workers,
naming the flag."""

from __future__ import annotations

import pytest

from tests.distributed.conftest import BASE, alive
from tests.engine.checkpoints import qwen3_next_checkpoint
from xllm_vmm import LLM, SamplingParams
from xllm_vmm.config import ConfigError

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(40, 75))]  # 35: over 2 blocks
FLAGS = {**BASE, "enable_prefix_cache": False}


@pytest.fixture(scope="module")
def next_dir(tmp_path_factory):
    return qwen3_next_checkpoint(tmp_path_factory.mktemp("tp-next"))


def local_state(eng):
    w = eng.worker
    for _ in range(4):  # through the engine's worker wrappers to the local worker's state
        backend = getattr(getattr(w, "runner", None), "backend", None)
        if backend is not None:
            return backend.state
        w = getattr(w, "local", None) or getattr(w, "worker", None) or getattr(w, "inner", None)
    raise AssertionError("no linear-state cache on the engine's worker")


def generate(model, **flags):
    llm = LLM(model=str(model), **FLAGS, **flags)
    eng = llm.llm_engine
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
        state = local_state(eng)
        info = {"state_bytes": state.bytes_per_seq, "state_slots": state.num_slots,
                "plan_state_bytes": eng.plan.layout.resident.bytes_per_seq,
                "plan_slots": eng.plan.workers[0].resident_slots,
                "pids": [s["pid"] for s in eng.distributed.worker_stats()] if eng.distributed else [],
                "kv": [s["kv_mapped_bytes"] for s in eng.distributed.worker_stats()]
                if eng.distributed else []}
        return [list(o.outputs[0].token_ids) for o in outs], info
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def next_one(next_dir):
    return generate(next_dir)


@pytest.mark.parametrize("flags", [{"nnodes": 2}, {"nnodes": 2, "ep_size": 2}])
def test_two_workers_equal_one_token_for_token(next_dir, next_one, flags):
    one, info1 = next_one
    two, info2 = generate(next_dir, **flags)
    assert two == one
    assert all(len(t) == GREEDY.max_tokens for t in two)
    # the resident state is this worker's shard: half the heads, as the plan's per-worker
    # figure says (and the running cache holds the plan's slots)
    assert info2["state_bytes"] == info2["plan_state_bytes"] == info1["state_bytes"] // 2
    assert info2["state_slots"] == info2["plan_slots"]
    assert len(set(info2["kv"])) == 1 and info2["kv"][0] > 0
    assert not any(alive(p) for p in info2["pids"][1:])


def test_prefix_cache_across_workers_is_refused_naming_the_flag(next_dir):
    with pytest.raises(ConfigError, match="enable_prefix_cache=true with 2 workers"):
        LLM(model=str(next_dir), **BASE, enable_prefix_cache=True, nnodes=2)
