"""A minimal driver-side harness for the worker tests: host driver -> VmmPool -> VirtualKVCache
-> Worker, with block tables handed out by the test (no scheduler, no KV cache manager).

``PagedStack.shuffled`` pre-allocates blocks over several slots (pages) and hands them to
sequences in a seeded random order, so block tables are non-contiguous and cross pages.
"""

from __future__ import annotations

import random

from xllm_vmm.engine.step import SeqChunk, StepInput
from xllm_vmm.engine.worker import Worker
from xllm_vmm.kvcache import VirtualKVCache
from xllm_vmm.models import cache_layout, load_model_spec
from xllm_vmm.pool import BudgetConfig, BudgetMode, VmmPool
from xllm_vmm.vmm import open_driver

MiB = 1 << 20


class PagedStack:
    def __init__(self, model_dir, *, block_size: int = 16, max_tokens: int = 65536,
                 dtype="auto", backend: str = "auto", shuffle_blocks: int = 0, seed: int = 0,
                 driver: str = "host", kv_dtype: str | None = None,
                 vmm_weights: bool = False) -> None:
        """``kv_dtype`` (a ``kv_cache_dtype`` value) defaults to ``dtype`` when that is a name
        other than auto, else ``auto`` (the checkpoint's dtype)."""
        spec = load_model_spec(str(model_dir))
        if kv_dtype is None:
            kv_dtype = dtype if isinstance(dtype, str) and dtype != "auto" else "auto"
        self.layout = cache_layout(spec, block_size=block_size, kv_dtype=kv_dtype)
        if driver == "acl":  # the bundled ACL emulation ("npu": a real NPU through libascendcl)
            self.driver = open_driver("acl", library="emulation", device_memory=512 * MiB)
        else:
            self.driver = open_driver(driver, device_memory=512 * MiB)
        page = self.driver.granularity
        arena = VirtualKVCache.arena_bytes(self.layout, page, max_tokens)
        if vmm_weights:  # the weights tenant takes the arena's high end (VMM-02: one budget)
            arena += (-(-(spec.weight_bytes or spec.estimated_weight_bytes) // page) + 2) * page
        self.pool = VmmPool(self.driver, BudgetConfig(mode=BudgetMode.ELASTIC,
                                                      execution_peak_bytes=0), arena)
        self.cache = VirtualKVCache.for_tokens(self.pool, self.layout, max_tokens)
        self.worker = Worker.create(model_dir, pool=self.pool, kv_cache=self.cache, dtype=dtype,
                                    attention_backend=backend, vmm_weights=vmm_weights)
        self.block_size = block_size
        self.tables: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self._spare: list[int] = []
        if shuffle_blocks:
            got = self.cache.allocate({"attn": shuffle_blocks})
            assert got is not None
            self._spare = list(got["attn"])
            random.Random(seed).shuffle(self._spare)

    def _blocks(self, n: int) -> list[int]:
        if self._spare:
            assert len(self._spare) >= n, "shuffle_blocks too small for the test"
            out, self._spare = self._spare[:n], self._spare[n:]
            return out
        got = self.cache.allocate({"attn": n})
        assert got is not None, "KV cache full"
        return got["attn"]

    def chunk(self, rid: str, token_ids: list[int], sample: bool = True) -> SeqChunk:
        start = self.computed.get(rid, 0)
        table = self.tables.setdefault(rid, [])
        need = -(-(start + len(token_ids)) // self.block_size) - len(table)
        if need > 0:
            table.extend(self._blocks(need))
        self.computed[rid] = start + len(token_ids)
        return SeqChunk(rid, list(token_ids), start, {"attn": list(table)}, sample)

    def step(self, chunks):
        return self.worker.execute(StepInput.build(chunks, self.block_size))

    def greedy(self, prompts: dict[str, list[int]], max_new: int, *, chunk: int | None = None,
               stagger: bool = False) -> dict[str, list[int]]:
        """Greedy continuation of every prompt, batched: prefill (in ``chunk``-token pieces
        when given) mixed with the others' decodes; ``stagger`` admits one prompt per step."""
        out = {r: [] for r in prompts}
        pending = {r: list(p) for r, p in prompts.items()}  # prompt tokens not computed yet
        admitted: list[str] = []
        order = list(prompts)
        while any(len(v) < max_new for v in out.values()):
            if stagger:
                if order:
                    admitted.append(order.pop(0))
            else:
                admitted, order = admitted + order, []
            chunks = []
            for r in admitted:
                if len(out[r]) >= max_new:
                    continue
                if pending[r]:
                    n = len(pending[r]) if chunk is None else min(chunk, len(pending[r]))
                    piece, pending[r] = pending[r][:n], pending[r][n:]
                    chunks.append(self.chunk(r, piece, sample=not pending[r]))
                else:
                    chunks.append(self.chunk(r, [out[r][-1]]))
            res = self.step(chunks)
            sampled = [c.request_id for c in chunks if c.sample]
            for r, row in zip(sampled, res.logits.argmax(-1).tolist()):
                out[r].append(row)
        return out

    def close(self) -> None:
        import gc

        self.worker.close()
        gc.collect()  # views held by reference cycles must be gone before the release
        self.pool.close()
        self.driver.close()
