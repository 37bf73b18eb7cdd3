"""The worker over the KV cache manager's cache: a prompt sharing a prefix with a finished one
computes only its suffix, reading the cached blocks the manager hands back, and its logits and
greedy tokens equal transformers' on the whole prompt."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.engine import checkpoints as C
from xllm_vmm.engine.step import SeqChunk, StepInput
from xllm_vmm.engine.worker import Worker
from xllm_vmm.kvcache import VirtualKVCache, build_kv_cache_manager
from xllm_vmm.models import cache_layout, load_model_spec
from xllm_vmm.pool import BudgetConfig, BudgetMode, VmmPool
from xllm_vmm.vmm import open_driver

BS = 16


@pytest.fixture
def managed(tmp_path):
    d = C.qwen2_checkpoint(tmp_path / "m")
    layout = cache_layout(load_model_spec(str(d)), block_size=BS)
    driver = open_driver("host", device_memory=256 << 20)
    pool = VmmPool(driver, BudgetConfig(mode=BudgetMode.ELASTIC, execution_peak_bytes=0),
                   VirtualKVCache.arena_bytes(layout, driver.granularity, 8192))
    mgr = build_kv_cache_manager(pool, layout, enable_prefix_cache=True, max_tokens=8192)
    worker = Worker.create(d, pool=pool, kv_cache=mgr.cache)
    yield d, mgr, worker
    worker.close()
    mgr.close()
    gc.collect()
    pool.close()
    driver.close()


def _run(mgr, worker, rid: str, prompt: list[int], new: int) -> tuple[list[int], int, torch.Tensor]:
    """Greedy through the manager (lookup, allocate, commit); returns tokens, the prefix hit's
    tokens and the prompt's last logits."""
    hit = mgr.lookup(rid, prompt)
    start = hit.num_tokens
    tables = mgr.allocate(rid, len(prompt) - start, hit=hit, num_prompt_tokens=len(prompt))
    assert tables is not None
    tokens = list(prompt)
    first_logits = None
    todo = prompt[start:]
    out: list[int] = []
    while len(out) < new:
        step = StepInput.build([SeqChunk(rid, todo, start, mgr.block_tables(rid), True)], BS)
        logits = worker.execute(step).logits[0]
        first_logits = logits if first_logits is None else first_logits
        start += len(todo)
        mgr.commit(rid, start, tokens)
        out.append(int(logits.argmax()))
        tokens.append(out[-1])
        todo = [out[-1]]
        if len(out) < new:
            assert mgr.allocate(rid, 1) is not None
    mgr.free(rid)
    return out, hit.num_tokens, first_logits


def test_prefix_hit_computes_only_the_suffix(managed):
    d, mgr, worker = managed
    hf = C.load_hf_model(d)
    shared = list(range(20, 20 + 3 * BS))  # three full blocks
    a = shared + [5, 6, 7]
    b = shared + [9, 10, 11, 12, 13]
    got_a, hit_a, _ = _run(mgr, worker, "a", a, 6)
    got_b, hit_b, logits_b = _run(mgr, worker, "b", b, 6)
    assert hit_a == 0 and hit_b == 3 * BS
    assert got_a == C.hf_greedy(hf, a, 6) and got_b == C.hf_greedy(hf, b, 6)
    with torch.no_grad():
        ref = hf(torch.tensor([b])).logits[0, -1]
    torch.testing.assert_close(logits_b, ref, atol=3e-4, rtol=0)
