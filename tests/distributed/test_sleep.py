"""Sleep and wakeup of a worker set complete on every worker before they return (a barrier)
and report each worker's freed bytes; the output after wakeup equals the output before."""

from __future__ import annotations

import pytest

from tests.distributed.conftest import BASE
from xllm_vmm.engine.llm_engine import LLMEngine
from xllm_vmm.engine.sampling_params import SamplingParams

SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = list(range(5, 45))  # 40 tokens: two full blocks stay in the prefix cache


def generate(eng, rid: str) -> list[int]:
    eng.add_request(rid, PROMPT, SP)
    toks: list[int] = []
    while eng.has_unfinished_requests():
        for o in eng.step():
            toks += o.new_token_ids
    return toks


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wakeup_on_every_worker(llama_dir, level):
    eng = LLMEngine.from_flags(str(llama_dir), **BASE, nnodes=2, enable_vmm_kvcache=True,
                               vmm_elastic=True, enable_vmm_weights=True, enable_prefix_cache=True)
    try:
        first = generate(eng, "a")
        before = eng.distributed.refresh()
        assert all(s["kv_mapped_bytes"] > 0 for s in before)  # cached prefix blocks, both
        rep = eng.sleep(level)
        workers = rep["workers"]
        assert [w["rank"] for w in workers] == [0, 1]
        for w, b in zip(workers, before):
            assert w["bytes_freed"] == b["mapped_bytes"] > 0  # weights shard + KV, per worker
            assert w["kv_bytes_freed"] == b["kv_mapped_bytes"]
            assert w["report"]["state"] == ("LIGHT_SLEEP" if level == 1 else "DEEP_SLEEP")
        assert [s["mapped_bytes"] for s in eng.distributed.refresh()] == [0, 0]
        woke = eng.wake_up()
        assert [w["state"] for w in woke["workers"]] == ["WAKEUP", "WAKEUP"]
        assert generate(eng, "b") == first
    finally:
        eng.shutdown()
