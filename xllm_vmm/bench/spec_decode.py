"""``xllm-vmm bench spec``: MTP speculative decoding against the same engine without it, side
by side in one run, on the same target, prompts and flags.

The setup is the test suite's (``tests/engine/test_spec_decode_mtp.py``, built by
:mod:`xllm_vmm.bench.tiny_checkpoint` and :mod:`xllm_vmm.bench.mtp_draft`): a tiny DeepSeek-V3
target (MLA, MoE; ``layers`` decoder layers, default 8: layer 0 dense, the others MoE; the
draft is one layer, so the deeper the target the more a skipped target pass saves — with the
tests' 2 layers the draft's two passes per step cost as much as the target pass they save)
whose residual branches are scaled down by ``branch_scale`` (default 0.01, so that eight
layers' branches together move the residual stream about as much as the tests' two at 0.03:
its next token depends mostly on the current one, so a one-layer draft can learn it in a few
hundred CPU steps — acceptance 0.77 at K = 2 with 150 steps, against 0.23 for 8 layers at
0.03; a real model is not scaled — the acceptance here is of this easy target, not
a prediction for real models), and an MTP draft distilled against it by the test setup's own
``distill_mtp`` (:mod:`xllm_vmm.bench.mtp_draft`; transformers' ``DeepseekV3DecoderLayer`` with autograd, ``distill_steps``
Adam steps), exported in the engine's MTP directory format. Both are built on first use under
the user's cache dir (keyed by every setting that changes them) and reused.

Fields (``repeats`` alternating runs of each engine over the same ``prompts`` greedy prompts of
``prompt_len`` seeded tokens, ``new_tokens`` each; min and median over the repeats):

- ``spec_speedup`` / ``spec_speedup_min``: output tokens/s with speculation over without, per
  repeat (median, least);
- ``plain_tokens_per_s_*`` / ``spec_tokens_per_s_*``: the two throughputs;
- ``acceptance_rate``, ``acceptance_per_pos_{j}`` (fraction of verifications whose j-th draft
  was accepted, j = 1..K), ``mean_accepted_length`` (tokens per verification, 1 + accepted):
  from the engine's ``stats()["spec_decode"]`` counters;
- ``target_passes_ratio``: engine steps with speculation over steps without (each step is one
  target pass);
- ``greedy_identical``: every output equal, token for token, to the plain engine's.

Threads: as ``bench engine`` does (its module docstring), unless ``OMP_WAIT_POLICY`` is already
set the bench sets it to ``PASSIVE`` before torch loads (``omp_wait_policy`` in the output;
``"unknown"`` when torch was loaded first): with torch's spinning default, a loaded 2-core
machine made single repeats of this bench collapse to 31-44 tok/s against ~1,500 for the
others.

Needs transformers (the checkpoint builder and the distillation run it; the package, not a
source checkout, holds them). Numbers are noisy on a shared machine: compare within one run.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Sequence


def bench_pair(branch_scale: float, distill_steps: int, seed: int = 0,
               layers: int = 8) -> tuple[Path, Path, float]:
    """The target and distilled draft directories (built on first use, see the module
    docstring) and the distillation's last loss over its first (nan when reused)."""
    import json
    import os
    import shutil

    from xllm_vmm.bench import mtp_draft as D
    from xllm_vmm.bench import tiny_checkpoint as C
    from xllm_vmm.engine.demo import cache_root

    depth = f"-l{layers}" if layers != 2 else ""
    base = cache_root() / f"bench-mtp-ds3{depth}-b{branch_scale:g}-s{distill_steps}-seed{seed}"
    target, draft = base / "target", base / "draft"
    done = base / "done.json"
    if done.is_file():
        return target, draft, float(json.loads(done.read_text()).get("loss_ratio", "nan"))
    tmp = base.with_name(base.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    C.deepseek_v3_checkpoint(tmp / "target", seed=seed, branch_scale=branch_scale,
                             **({"num_hidden_layers": layers} if layers != 2 else {}))
    _, losses = D.distill_mtp(tmp / "target", tmp / "draft", steps=distill_steps, sequences=48,
                              batch=16, gen_len=26, seed=seed)
    ratio = losses[-1] / losses[0] if losses else float("nan")
    (tmp / "done.json").write_text(json.dumps({"loss_ratio": ratio, "losses": losses[::10]}))
    shutil.rmtree(base, ignore_errors=True)
    os.replace(tmp, base)
    # the draft's config points at nothing outside its directory; the paths moved with it
    return target, draft, ratio


def _stats(xs: Sequence[float]) -> tuple[float, float]:
    return min(xs), statistics.median(xs)


def run(*, k: int = 2, prompts: int = 8, prompt_len: int = 6, new_tokens: int = 32,
        repeats: int = 3, branch_scale: float = 0.01, distill_steps: int = 150, layers: int = 8,
        block_size: int = 16, device_memory: str = "256MiB", elastic: bool = True,
        threads: int | None = None, seed: int = 0) -> dict[str, Any]:
    """Run the benchmark (module docstring); returns a flat dict of results."""
    for name, v, lo in (("k", k, 1), ("prompts", prompts, 1), ("prompt_len", prompt_len, 1),
                        ("new_tokens", new_tokens, 2), ("repeats", repeats, 1),
                        ("distill_steps", distill_steps, 1), ("layers", layers, 2)):
        if v < lo:
            raise ValueError(f"--{name.replace('_', '-')} must be at least {lo}, got {v}")
    if not 0 < branch_scale <= 1:
        raise ValueError(f"--branch-scale must be in (0, 1], got {branch_scale}")
    from xllm_vmm.bench.threads import passive_omp_wait

    policy = passive_omp_wait()
    import torch

    from xllm_vmm.engine.llm import LLM
    from xllm_vmm.engine.sampling_params import SamplingParams

    if threads is not None:
        torch.set_num_threads(threads)
    target, draft, loss_ratio = bench_pair(branch_scale, distill_steps, seed, layers)
    g = torch.Generator().manual_seed(seed + 77)
    trace = [torch.randint(4, 384, (prompt_len,), generator=g).tolist() for _ in range(prompts)]
    flags = dict(block_size=block_size, device_memory=device_memory, enable_vmm_kvcache=True,
                 vmm_elastic=elastic, max_seqs_per_batch=max(prompts, 1),
                 enable_prefix_cache=False)
    plain = LLM(str(target), **flags)
    spec = LLM(str(target), draft_model=str(draft), speculative_algorithm="MTP",
               num_speculative_tokens=k, **flags)
    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
    rates: dict[str, list[float]] = {"plain": [], "spec": []}
    steps: dict[str, int] = {}
    outs: dict[str, list] = {}
    try:
        for llm in (plain, spec):  # warm-up (first-call allocations), not measured
            llm.generate([{"prompt_token_ids": p} for p in trace[:1]],
                         SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        spec_base = dict(spec.llm_engine.stats()["spec_decode"])
        for _ in range(repeats):
            for key, llm in (("plain", plain), ("spec", spec)):
                before = llm.llm_engine.num_steps
                t0 = time.perf_counter()
                res = llm.generate([{"prompt_token_ids": p} for p in trace], sp)
                dt = time.perf_counter() - t0
                rates[key].append(prompts * new_tokens / dt)
                steps[key] = llm.llm_engine.num_steps - before
                outs.setdefault(key, [list(o.outputs[0].token_ids) for o in res])
        sd = spec.llm_engine.stats()["spec_decode"]
    finally:
        plain.llm_engine.shutdown()
        spec.llm_engine.shutdown()
    drafts = sd["num_drafts"] - spec_base["num_drafts"]
    dtok = sd["num_draft_tokens"] - spec_base["num_draft_tokens"]
    acc = sd["num_accepted_tokens"] - spec_base["num_accepted_tokens"]
    per_pos = [a - b for a, b in zip(sd["num_accepted_tokens_per_pos"],
                                     spec_base["num_accepted_tokens_per_pos"])]
    ratios = [s / p for s, p in zip(rates["spec"], rates["plain"])]
    out: dict[str, Any] = {
        "num_speculative_tokens": k, "prompts": prompts, "new_tokens": new_tokens,
        "repeats": repeats, "target_layers": layers, "target_branch_scale": branch_scale,
        "distill_steps": distill_steps, "distill_loss_ratio": loss_ratio,
        "spec_speedup": statistics.median(ratios), "spec_speedup_min": min(ratios),
    }
    for key in ("plain", "spec"):
        lo, med = _stats(rates[key])
        out[f"{key}_tokens_per_s_min"], out[f"{key}_tokens_per_s_median"] = lo, med
    out["acceptance_rate"] = acc / dtok if dtok else 0.0
    for j, a in enumerate(per_pos, start=1):
        out[f"acceptance_per_pos_{j}"] = a / drafts if drafts else 0.0
    out["mean_accepted_length"] = 1.0 + acc / drafts if drafts else 0.0
    out["target_passes_ratio"] = steps["spec"] / steps["plain"] if steps.get("plain") else 0.0
    out["greedy_identical"] = outs["spec"] == outs["plain"]
    out["omp_wait_policy"] = policy
    out["threads"] = torch.get_num_threads()
    return out


__all__ = ["bench_pair", "run"]
