"""A driver-side harness over the real pieces, for the MLA / hybrid / MTP model tests:
host driver -> VmmPool -> KVCacheManager (prefix cache optional) -> Scheduler -> Worker, greedy.

``vmm=True`` runs the elastic virtual pool (pages mapped on demand); ``vmm=False`` the physical
budget (``enable_vmm_kvcache=false``: the arena is the KV pool). ``max_batch_tokens`` small
forces chunked prefill. The layout is the one ``plan`` computes
(:func:`xllm_vmm.models.cache_layout`), so the cache groups are the model's own ("mla", "attn"
of a hybrid's full-attention layers, ...).
"""

from __future__ import annotations

import gc

from xllm_vmm.engine.linear_state import attach_linear_state
from xllm_vmm.engine.request import Request
from xllm_vmm.engine.sampling_params import SamplingParams
from xllm_vmm.engine.scheduler import Scheduler
from xllm_vmm.engine.worker import Worker
from xllm_vmm.kvcache import VirtualKVCache, build_kv_cache_manager
from xllm_vmm.models import cache_layout, load_model_spec
from xllm_vmm.pool import BudgetConfig, BudgetMode, VmmPool
from xllm_vmm.vmm import open_driver

MiB = 1 << 20


class ManagedStack:
    def __init__(self, model_dir, *, block_size: int = 16, max_tokens: int = 4096,
                 vmm: bool = True, prefix: bool = False, max_batch_tokens: int = 512,
                 max_seqs: int = 8, draft_dir=None, host_blocks_factor: float = 0.0) -> None:
        """``draft_dir``: an MTP draft directory; its cache is the layout's ``"draft"`` group
        (SD-01) and :attr:`draft` the loaded module."""
        spec = load_model_spec(str(model_dir))
        draft_spec = load_model_spec(str(draft_dir)) if draft_dir is not None else None
        self.layout = cache_layout(spec, block_size=block_size, draft=draft_spec is not None,
                                   draft_spec=draft_spec)
        self.driver = open_driver("host", device_memory=512 * MiB)
        page = self.driver.granularity
        arena = VirtualKVCache.arena_bytes(self.layout, page, max_tokens)
        mode = BudgetMode.ELASTIC if vmm else BudgetMode.PHYSICAL
        self.pool = VmmPool(self.driver, BudgetConfig(mode=mode, execution_peak_bytes=0), arena)
        self.mgr = build_kv_cache_manager(self.pool, self.layout, enable_prefix_cache=prefix,
                                          max_tokens=max_tokens,
                                          host_blocks_factor=host_blocks_factor)
        self.worker = Worker.create(str(model_dir), pool=self.pool, kv_cache=self.mgr.cache)
        self.draft = None
        if draft_dir is not None:
            from xllm_vmm.engine.spec_decode import MtpDraft

            self.draft = MtpDraft.load(draft_dir, self.mgr.cache)
        # hybrid models: state slots + checkpoints around the manager and the worker
        self.sched_mgr, self.runner = attach_linear_state(self.mgr, self.worker, max_seqs=max_seqs)
        self.sched = Scheduler(self.sched_mgr, max_tokens_per_batch=max_batch_tokens,
                               max_seqs_per_batch=max_seqs, max_model_len=max_tokens,
                               pool=self.pool)
        self.steps: list = []  # every StepInput run (tests inspect chunking / prefix hits)

    def generate(self, prompts: dict[str, list[int]], max_new: int) -> dict[str, list[int]]:
        """Greedy continuations (exactly ``max_new`` tokens each, eos ignored)."""
        for rid, ids in prompts.items():
            self.sched.add_request(Request(rid, list(ids), SamplingParams(
                temperature=0, max_tokens=max_new, ignore_eos=True)))
        out: dict[str, list[int]] = {rid: [] for rid in prompts}
        while self.sched.has_unfinished():
            plan = self.sched.schedule()
            if plan.step is None:
                self.sched.update(plan, [])
                continue
            self.steps.append(plan.step)
            res = self.runner.execute(plan.step)
            toks = res.logits.argmax(-1).tolist()
            for o in self.sched.update(plan, toks, None, res.execution_peak_bytes):
                out[o.request_id].extend(o.new_token_ids)
        return out

    def close(self) -> None:
        if self.draft is not None:
            self.draft.close()
        self.worker.close()
        self.mgr.close()
        gc.collect()  # views held by reference cycles must be gone before the release
        self.pool.close()
        self.driver.close()
