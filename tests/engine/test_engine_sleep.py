"""LLMEngine sleep / wake_up / fork: composed from the weights' SleepController (B) and the KV
cache manager (A); refused while requests run unless drain; outputs identical after wakeup;
a fork serves the same tokens over the same weight pages."""

from __future__ import annotations

import pytest

from tests.engine.checkpoints import llama_checkpoint
from xllm_vmm import LLM, SamplingParams
from xllm_vmm.weights import SleepRefused, WeightVmmRequired

SP = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
PROMPT = [5, 6, 7, 8] * 10


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return llama_checkpoint(tmp_path_factory.mktemp("sleep"))


def run(eng, rid, prompt=PROMPT):
    eng.add_request(rid, prompt, SP)
    toks = []
    while eng.has_unfinished_requests():
        for o in eng.step():
            toks += o.new_token_ids
    return toks


@pytest.mark.parametrize("elastic", [True, False])
def test_sleep_levels_release_memory_and_outputs_stay(model, elastic):
    with LLM(str(model), block_size=16, device_memory="96MiB", enable_vmm_kvcache=True,
             vmm_elastic=elastic, enable_vmm_weights=True) as llm:
        eng = llm.llm_engine
        before = llm.generate([PROMPT], SP)[0].outputs[0].token_ids
        mapped = eng.stats()["pool_tenant_mapped_bytes"]
        assert mapped["weights"] > 0 and mapped["kv"] > 0
        rep = eng.sleep(1)
        assert eng.is_sleeping() and rep["state"] == "LIGHT_SLEEP"
        if elastic:
            assert rep["kv_bytes_freed"] == mapped["kv"]
            assert rep["bytes_freed"] == mapped["kv"] + mapped["weights"]
            assert eng.stats()["pool_tenant_mapped_bytes"] == {"weights": 0, "kv": 0}
        else:  # a fixed pool keeps its pages backed (EL-03): nothing goes back to the device
            assert rep["bytes_freed"] == 0
        assert eng.step() == []                      # nothing runs while asleep
        assert eng.wake_up()["source"] == "host_copy"
        assert eng.wake_up()["source"] == "none"     # idempotent
        assert llm.generate([PROMPT], SP)[0].outputs[0].token_ids == before
        assert eng.sleep(2)["state"] == "DEEP_SLEEP"
        assert eng.wake_up()["source"] == "checkpoint"
        assert llm.generate([PROMPT], SP)[0].outputs[0].token_ids == before


def test_sleep_refused_while_requests_run_unless_drain(model):
    with LLM(str(model), block_size=16, device_memory="96MiB", enable_vmm_kvcache=True,
             vmm_elastic=True, enable_vmm_weights=True) as llm:
        eng = llm.llm_engine
        eng.add_request("a", PROMPT, SP)
        eng.step()
        with pytest.raises(SleepRefused):
            eng.sleep()
        assert not eng.is_sleeping() and eng.has_unfinished_requests()
        with pytest.raises(SleepRefused):
            eng.sleep(drain=True, timeout=0)
        rep = eng.sleep(drain=True, timeout=60)
        assert rep["state"] == "LIGHT_SLEEP" and not eng.has_unfinished_requests()
        eng.wake_up()


def test_sleep_and_fork_need_weights_in_the_pool(model):
    with LLM(str(model), block_size=16, device_memory="96MiB", enable_vmm_kvcache=True) as llm:
        with pytest.raises(WeightVmmRequired):
            llm.llm_engine.sleep()
        with pytest.raises(WeightVmmRequired):
            llm.llm_engine.fork()


def test_fork_shares_the_weight_pages(model):
    with LLM(str(model), block_size=16, device_memory="96MiB", enable_vmm_kvcache=True,
             vmm_elastic=True, enable_vmm_weights=True) as llm:
        eng = llm.llm_engine
        ref = run(eng, "a")
        child = eng.fork()
        try:
            assert child.weights.shares_pages_with(eng.weights)
            assert "weights" not in child.stats()["pool_tenant_mapped_bytes"]
            assert run(child, "b") == ref
            assert run(eng, "c") == ref
        finally:
            child.shutdown()
        assert run(eng, "d") == ref                  # the parent's weights outlive the fork


def test_parent_shutdown_shuts_its_forks_down_first(model):
    llm = LLM(str(model), block_size=16, device_memory="96MiB", enable_vmm_kvcache=True,
              vmm_elastic=True, enable_vmm_weights=True)
    eng = llm.llm_engine
    child = eng.fork()
    assert run(child, "a") == run(eng, "b")
    eng.shutdown()                     # the driver goes with the parent: the fork first
    assert child._closed
    child.shutdown()                   # idempotent


def test_fork_without_room_for_its_kv_cache_says_what_to_set(model):
    """A fixed KV cache takes the plan's whole KV budget: a fork has no room for its own and is
    refused with ForkDoesNotFit naming max_cache_size, leaving nothing behind (the parent keeps
    serving; with max_cache_size leaving room the same fork works)."""
    from xllm_vmm.engine.llm_engine import ForkDoesNotFit

    flags = dict(block_size=16, device_memory="96MiB", enable_vmm_kvcache=True,
                 vmm_elastic=False, enable_vmm_weights=True)
    with LLM(str(model), **flags) as llm:
        eng = llm.llm_engine
        ref = run(eng, "a")
        held = eng.driver.mem_info().free
        with pytest.raises(ForkDoesNotFit, match="max_cache_size"):
            eng.fork()
        assert eng.driver.mem_info().free == held      # the failed fork gave everything back
        assert eng._forks == [] and run(eng, "b") == ref
    with LLM(str(model), **flags, max_cache_size=16 << 20) as llm:
        eng = llm.llm_engine
        child = eng.fork()
        try:
            assert run(child, "c") == run(eng, "d")
        finally:
            child.shutdown()
