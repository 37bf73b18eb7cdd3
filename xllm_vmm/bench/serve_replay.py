"""``xllm-vmm bench serve --engine-only``: ``bench serve``'s load replayed straight on the engine,
without the server — the server's share of the serving time is the difference.

The same prompts and arrival times as :func:`xllm_vmm.bench.serve.drive` for the same seed
(:func:`~xllm_vmm.bench.serve.make_load`, with the engine's vocabulary and context), the same
engine built from the same ``serve`` flags (:meth:`LLMEngine.from_args`), the same greedy
``ignore_eos`` budgets, and one warm-up request first. One thread does what serve's engine
thread does — add the requests whose arrival time has come, ``step()`` while any is
unfinished, sleep until the next arrival otherwise — and nothing else: no HTTP, no
tokenization or detokenization, no output thread, no other thread competing for the
interpreter lock. TTFT is arrival → the step that returned the first token; TPOT and ITL as
``drive`` computes them (per step that returned tokens).

OpenMP's wait policy: run this way on the loaded 2-vCPU machine, the replay's steps were 5-13x
slower than the same steps inside ``serve`` (510 vs 38 ms mean at load ~8; 1,382 ms with two
intra-op threads vs 73 ms with one at load ~15), and 53 ms with ``OMP_WAIT_POLICY=PASSIVE``
(the OpenMP workers sleep instead of spinning between parallel regions), while ``serve``'s own
steps did not change with that setting (56-67 vs 67-69 ms, two runs each). So that the two
measure the same engine, :func:`replay` sets ``OMP_WAIT_POLICY=PASSIVE`` when torch is not
imported yet and the variable is unset, and reports it as ``omp_wait_policy``.

Figures: ``drive``'s names where they apply (``output_throughput``, ``request_throughput``,
``ttft_ms_*``, ``tpot_ms_*``, ``itl_ms_*``, ``completed``, ``failures``, ``engine_steps``,
``engine_step_ms_mean``, ``engine_busy_fraction``, ``duration_s``), ``mode: "engine-only"``,
``omp_wait_policy``.
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional

from xllm_vmm.bench.serve import LoadConfig, latency_figures, make_load

# serve's own options that are engine options (LLMEngine.from_args keyword arguments)
_OPTIONS = {"max_model_len": "max_model_len", "max-model-len": "max_model_len",
            "device_memory": "device_memory", "device-memory": "device_memory",
            "dtype": "dtype"}


def engine_args(serve_args: list[str]) -> tuple[Optional[str], list[str], dict[str, Any]]:
    """``serve``'s arguments as (model, engine flag tokens, engine options). Every flag must be
    written ``--name=value`` (as :func:`~xllm_vmm.bench.serve.serve_args` writes them) except
    ``--model DIR``."""
    model: Optional[str] = None
    flags: list[str] = []
    options: dict[str, Any] = {}
    it = iter(serve_args)
    for a in it:
        name, eq, value = a.lstrip("-").partition("=")
        if name == "model":
            model = value if eq else next(it, None)
        elif name in _OPTIONS:
            if not eq:
                value = next(it, "")
            options[_OPTIONS[name]] = int(value) if _OPTIONS[name] == "max_model_len" else value
        elif name in ("port", "host", "api-key", "api_key", "enable-admin", "enable_admin"):
            if not eq and name in ("port", "host", "api-key", "api_key"):
                next(it, None)
        else:
            if not eq:
                raise ValueError(f"--engine-only: write serve's flag as --{name}=VALUE")
            flags.append(a)
    return model, flags, options


def replay(cfg: LoadConfig, serve_args: list[str]) -> dict:
    """Run the load on an engine built from ``serve_args``; the figures of the module
    docstring."""
    from xllm_vmm.bench.threads import passive_omp_wait

    passive_omp_wait()
    from xllm_vmm.engine import LLMEngine, SamplingParams

    cfg.check()
    model, flags, options = engine_args(serve_args)
    engine = LLMEngine.from_args(model, flags, **options)
    try:
        out = _run(engine, cfg, SamplingParams)
    finally:
        engine.shutdown()
    out["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY")
    return out


def _run(engine, cfg: LoadConfig, sampling_params) -> dict:
    sizes = [v for v in (getattr(engine, "vocab_size", None),
                         getattr(engine.tokenizer, "vocab_size", None)) if v]
    vocab = int(cfg.vocab or (min(sizes) if sizes else 256))
    prompts, gaps, lo = make_load(cfg, vocab, int(engine.max_model_len))
    greedy = sampling_params(max_tokens=cfg.output_len, ignore_eos=True, temperature=0.0)

    # warm-up (not counted), as drive sends one
    engine.add_request("warm", prompts[0][: max(1, lo)],
                       sampling_params(max_tokens=min(cfg.output_len, 4), ignore_eos=True,
                                       temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()

    arrivals, t = [], 0.0
    for g in gaps:
        t += g
        arrivals.append(t)
    n = len(prompts)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    got: dict[str, int] = {}
    itl: list[float] = []
    finished: dict[str, float] = {}
    step_s, steps, nxt = 0.0, 0, 0
    t0 = time.perf_counter()
    deadline = t0 + cfg.timeout
    while len(finished) < n and time.perf_counter() < deadline:
        now = time.perf_counter() - t0
        while nxt < n and arrivals[nxt] <= now:
            engine.add_request(f"r{nxt}", prompts[nxt], greedy)
            nxt += 1
        if not engine.has_unfinished_requests():
            if nxt < n:
                time.sleep(max(0.0, arrivals[nxt] - (time.perf_counter() - t0)))
            continue
        s0 = time.perf_counter()
        outs = engine.step()
        s1 = time.perf_counter()
        step_s += s1 - s0
        steps += 1
        when = s1 - t0
        for o in outs:
            k = len(o.new_token_ids)
            if k:
                rid = o.request_id
                if rid not in first:
                    first[rid] = when
                else:
                    itl.append((when - last[rid]) / k)
                last[rid] = when
                got[rid] = got.get(rid, 0) + k
            if o.finished:
                finished[o.request_id] = when
    wall = time.perf_counter() - t0
    ok = [f"r{i}" for i in range(n) if got.get(f"r{i}") == cfg.output_len
          and f"r{i}" in finished]
    ttft = [first[r] - arrivals[int(r[1:])] for r in ok]
    tpot = [(finished[r] - first[r]) / (cfg.output_len - 1) for r in ok if cfg.output_len > 1]
    out_tokens = sum(got[r] for r in ok)
    return {
        "mode": "engine-only", "completed": len(ok), "failures": n - len(ok),
        "num_prompts": cfg.num_prompts,
        "request_rate": "inf" if cfg.request_rate == float("inf") else cfg.request_rate,
        "input_len": cfg.input_len, "range_ratio": cfg.range_ratio,
        "output_len": cfg.output_len, "duration_s": wall,
        "output_throughput": out_tokens / wall if wall > 0 else 0.0,
        "request_throughput": len(ok) / wall if wall > 0 else 0.0,
        "total_output_tokens": out_tokens,
        **latency_figures(ttft, tpot, itl),
        "engine_steps": steps, "engine_step_ms_mean": 1e3 * step_s / steps if steps else None,
        "engine_busy_fraction": step_s / wall if wall > 0 else None,
    }
