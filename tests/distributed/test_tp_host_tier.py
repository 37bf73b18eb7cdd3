"""The host KV tier across two gloo workers: every offload (device→host) and restore
(host→device) runs on every worker, each between its own blocks and its own host pool, all or
nothing. A prompt whose cached blocks were pushed off the one-slot device comes back from the
host tier on both workers: the same tokens as one worker, restored blocks counted."""

from __future__ import annotations

import pytest

from tests.distributed.conftest import alive
from tests.engine.checkpoints import llama_checkpoint
from xllm_vmm import LLM, SamplingParams

SP = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
ONE_SLOT = 4 * 2 * 1024 * 1024  # one 2 MiB page per K/V tensor of 2 layers (per worker)


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + 11 * salt + 5) % 300 + 4 for i in range(n)]


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    # 8 KV heads x head_dim 256 fp32: 8 KiB per token per tensor (4 KiB per worker of two),
    # so one page per tensor is one small slot
    return llama_checkpoint(tmp_path_factory.mktemp("tp-wide"), num_attention_heads=8,
                            num_key_value_heads=8, head_dim=256)


def run(model, **flags):
    llm = LLM(model=str(model), block_size=16, device_memory="96MiB", enable_vmm_kvcache=True,
              vmm_elastic=True, enable_prefix_cache=True, host_blocks_factor=4,
              max_cache_size=ONE_SLOT, max_tokens_per_batch=512, **flags)
    eng = llm.llm_engine
    try:
        first = {"prompt_token_ids": prompt(100, 1)}
        toks = [llm.generate([first], SP)[0].outputs[0].token_ids]
        for s in range(2, 6):  # other prompts fill the one device slot: first's blocks leave it
            toks.append(llm.generate([{"prompt_token_ids": prompt(200, s)}], SP)[0]
                        .outputs[0].token_ids)
        again = llm.generate([first], SP)[0]
        toks.append(again.outputs[0].token_ids)
        st = eng.kv_cache_manager.stats()
        pids = [s["pid"] for s in eng.distributed.worker_stats()] if eng.distributed else []
        return toks, st, again.num_cached_tokens, pids
    finally:
        eng.shutdown()


def test_restores_on_every_worker_equal_one_worker(wide):
    one, st1, cached1, _ = run(wide)
    two, st2, cached2, pids = run(wide, nnodes=2)
    assert st1["host_restored_blocks"] > 0 and st2["host_restored_blocks"] > 0
    assert st2["host_offloaded_blocks"] > 0
    assert cached2 == cached1 == 96
    assert two == one
    assert not alive(pids[1])


def sleep_cycle(model, **flags):
    """Serve a prompt, light-sleep (its cached blocks go to the host tier on every worker),
    wake up and serve it again: the second pass restores them from the host tier."""
    llm = LLM(model=str(model), block_size=16, device_memory="96MiB", enable_vmm_kvcache=True,
              vmm_elastic=True, enable_vmm_weights=True, enable_prefix_cache=True,
              host_blocks_factor=4, max_tokens_per_batch=512, **flags)
    eng = llm.llm_engine
    try:
        first = {"prompt_token_ids": prompt(100, 7)}
        before = llm.generate([first], SP)[0].outputs[0].token_ids
        eng.sleep(1)
        assert eng.is_sleeping()
        eng.wake_up()
        again = llm.generate([first], SP)[0]
        st = eng.kv_cache_manager.stats()
        pids = [s["pid"] for s in eng.distributed.worker_stats()] if eng.distributed else []
        return before, again.outputs[0].token_ids, again.num_cached_tokens, st, pids
    finally:
        eng.shutdown()


def test_sleep_offloads_to_the_host_tier_on_every_worker(wide):
    b1, a1, cached1, st1, _ = sleep_cycle(wide)
    b2, a2, cached2, st2, pids = sleep_cycle(wide, nnodes=2)
    assert st1["host_restored_blocks"] > 0 and st2["host_restored_blocks"] > 0
    assert cached2 == cached1 == 96
    assert a2 == b2 == a1 == b1
    assert not alive(pids[1])
