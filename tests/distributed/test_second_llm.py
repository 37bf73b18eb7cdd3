"""A dropped or shut-down multi-worker LLM releases its worker processes and its process group:
a second ``LLM(..., nnodes=2)`` in the same process starts and serves."""

from __future__ import annotations

import gc

import pytest

from tests.distributed.conftest import BASE
from xllm_vmm.engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.mark.parametrize("drop", ["shutdown", "del"])
def test_a_second_two_worker_llm_starts_after_the_first_is_dropped(llama_dir, drop):
    first = LLM(str(llama_dir), nnodes=2, max_model_len=64, **BASE)
    ref = first.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    procs = list(first.llm_engine.distributed.procs)
    if drop == "shutdown":
        first.shutdown()
    del first
    gc.collect()
    assert all(p.poll() is not None for p in procs)  # its workers are gone
    second = LLM(str(llama_dir), nnodes=2, max_model_len=64, **BASE)
    try:
        assert second.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == ref
    finally:
        second.shutdown()


def test_a_second_worker_set_while_one_lives_is_refused_at_once(llama_dir):
    from xllm_vmm.engine.distributed.errors import DistributedError

    first = LLM(str(llama_dir), nnodes=2, max_model_len=64, **BASE)
    try:
        with pytest.raises(DistributedError) as e:
            LLM(str(llama_dir), nnodes=2, max_model_len=64, **BASE)
        assert "already has a live worker set" in str(e.value)
    finally:
        first.shutdown()
