"""``xllm-vmm bench serve --vllm-venv PATH``: our server and ``vllm serve`` of vLLM's CPU build,
side by side under the same load.

What is compared: the same checkpoint (the bench Llama by default), the same dtype (bfloat16
unless ``--dtype`` is given to serve), the same context (``--max-model-len``), the same load
generator (:func:`xllm_vmm.bench.serve.drive`) with the same seeds and token-id range, hence the
same prompts, arrivals and budgets (``ignore_eos``), and each side's own default settings (vLLM:
its CPU platform's thread binding, one OpenMP thread bound to one core with the other core kept
for its API server and engine core; ours: torch's threads). ``vllm_env`` adds environment
variables to vLLM's (its own tuning knobs, e.g. ``VLLM_CPU_OMP_THREADS_BIND``); they are
reported in ``vllm.env``.

How (the order is what makes the figures stable on a small noisy machine):

1. **One server on the machine at a time** (``residency="exclusive"``, the default): every
   run starts its side's server (not timed into the figures; ``startup_s_median``), gives it
   the warm-up load below, measures it and stops it (its whole process tree: nothing of it
   is left in memory) before the next side starts. The sides are ``xllm_vmm``, the headline
   (what ``xllm-vmm serve`` runs with the KV cache in the elastic pool and its default
   weights: plain tensors, fused and oneDNN-packed); with ``vmm_weights_side``,
   ``xllm_vmm_vmm_weights`` (ours with the weights in the pool too: referenced in the pool,
   never copied — sleep, wakeup and fork rely on it — so their projections run unfused and
   unpacked, ~1.6x the matmul CPU at decode sizes); and ``vllm``. Why not keep every server
   up: a resident server's memory slows the one being measured when it is an elastic one. On
   this virtual machine the host backs guest memory lazily: with ~4 GB more of it in use
   (an idle ``vllm serve``'s 4.5 GB of processes and 2 GiB of KV, even paused), writing a
   page for the first time cost 16-56 us instead of 2, and every page our KV cache maps
   while it grows is one (``docs/benchmarks.md``, "Residency": with vLLM paused beside it our
   TPOT was 38-44 ms, and 12-16 ms without it; with the KV cache mapped up front
   (``--vmm_elastic=false``) a paused 7 GB process changed nothing, so it is the page
   commits). vLLM, which commits its KV space at start-up, does not feel it.
   ``residency="shared"``: every server is started once, one after
   the other, and stays up; the idle ones are paused during each run (SIGSTOP, SIGCONT after
   it; ``pause_idle``, reported as ``idle_server_paused``: an idle ``vllm serve`` is not
   quiet — its worker's 12 ``gloo_tcp_loop`` threads woke ~1,300 times a second here) and
   ``idle_server_cpu_s`` (the CPU seconds the idle trees used during the run, from
   ``/proc``) shows they stayed idle. Each run reports ``resident_servers`` (servers up
   during it) and ``host_memory_used_bytes_start`` (the machine's memory in use as it
   began).
2. Every server gets the same **warm-up load** after its start — the measured load's shape
   (lengths, rate, output budget) with ``warmup_prompts`` prompts of another seed — not
   counted (``warmup`` in each side's figures: its first one): the first load after
   start-up pays one-time costs on both sides (allocator growth, oneDNN primitives per
   shape, lazy imports; vLLM's first load ran 2-4x its later TTFT here).
3. ``rounds`` measured rounds; round *i* drives every side with the load of seed
   ``seed + i`` (the same prompts for every side within a round, new prompts every round, so
   that no prefix cache serves a repeat), ours first in even rounds and vLLM's first in odd
   ones (drift in the machine's load cancels over pairs; ``order="fixed"`` keeps the even
   rounds' order). One server is driven at a time; ``settle_s`` seconds pass between runs.

Figures (:func:`compare`): per side, ``runs`` (each run's ``drive`` figures, with ``round``,
``seed``, ``resident_servers``, ``host_memory_used_bytes_start`` and ``idle_server_cpu_s``),
``warmup``, ``startups`` and ``startup_s_median``, and over the runs ``output_throughput_min`` /
``_median``, ``ttft_ms_min`` / ``_median``, ``tpot_ms_min`` / ``_median``, ``itl_ms_median``
(min and median over runs of each run's median), ``rss_bytes_peak_median``, the server's own
latency (``server_*_us_*``, medians over runs; None for vLLM) and vLLM's own stages
(``vllm_queue_ms_mean``, ``vllm_prefill_ms_mean``: its queue and prefill time per request,
``vllm_steps``; None for ours), ``failures`` (all runs); ``vs_vllm_throughput_ratio`` = our median output throughput /
vLLM's (> 1: ours is faster), ``vs_vllm_ttft_ratio`` and ``vs_vllm_tpot_ratio`` (our median /
theirs: < 1 is better), and per round (the pairs closest in time)
``vs_vllm_throughput_ratio_per_round``, ``vs_vllm_ttft_ratio_per_round``,
``vs_vllm_tpot_ratio_per_round``.

vLLM's server: ``VENV/bin/vllm serve MODEL --dtype D --host 127.0.0.1 --port P --max-model-len L``
with ``VLLM_TARGET_DEVICE=cpu`` and ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB of KV reserved up front), in
its own session (its engine core and worker processes are stopped with it: SIGTERM to the
group, SIGKILL after a grace period); ready when ``/health`` answers 200. Its log goes to a
temporary file; a start that fails reports the exit code and the log's last lines, and the
comparison still reports our side (``vllm.error``). Nothing here imports torch.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

from dataclasses import replace

from xllm_vmm.bench.residency import RESIDENCIES
from xllm_vmm.bench.proctree import host_memory_used_bytes, signal_tree, tree_cpu_seconds
from xllm_vmm.bench.serve import LoadConfig, ServerProcess, drive, run_load
from xllm_vmm.engine.cpu_caps import caps
from xllm_vmm.engine.paths import parse_paths_line

#: the warm-up load's seed is the measured seed plus this (prompts no measured round sends)
WARMUP_SEED_OFFSET = 1000


def _flag_value(args: list[str], name: str) -> Optional[str]:
    """The value of ``--name=V`` / ``--name V`` (dashes or underscores) in serve's arguments;
    the last one wins, as serve's own parser."""
    want = {f"--{name}", f"--{name.replace('_', '-')}", f"--{name.replace('-', '_')}"}
    value = None
    for i, a in enumerate(args):
        key, eq, v = a.partition("=")
        if key in want:
            value = v if eq else (args[i + 1] if i + 1 < len(args) else None)
    return value


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VllmServer:
    """``vllm serve`` of the CPU build in ``venv``, on a free loopback port; ``url`` once
    ``/health`` answers. ``kv_space_gib``: ``VLLM_CPU_KVCACHE_SPACE``."""

    def __init__(self, venv: str | os.PathLike, model: str, *, dtype: str = "bfloat16",
                 max_model_len: Optional[int] = None, kv_space_gib: int = 2,
                 start_timeout: float = 300.0, env: Optional[dict[str, str]] = None):
        self.exe = Path(venv) / "bin" / "vllm"
        self.model = model
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.kv_space_gib = kv_space_gib
        self.start_timeout = start_timeout
        self.extra_env = dict(env or {})
        self.proc: Optional[subprocess.Popen] = None
        self.url: Optional[str] = None
        self._log: Optional[tempfile._TemporaryFileWrapper] = None

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc is not None else None

    @property
    def args(self) -> list[str]:
        port = self.url.rsplit(":", 1)[1] if self.url else "PORT"
        a = [str(self.exe), "serve", self.model, "--dtype", self.dtype, "--host", "127.0.0.1",
             "--port", port]
        if self.max_model_len:
            a += ["--max-model-len", str(self.max_model_len)]
        return a

    def log_tail(self, lines: int = 15) -> str:
        if self._log is None:
            return ""
        try:
            with open(self._log.name, errors="replace") as fh:
                return "\n".join(fh.read().splitlines()[-lines:])
        except OSError:
            return ""

    def start(self) -> "VllmServer":
        import httpx

        if not self.exe.is_file():
            raise RuntimeError(f"--vllm-venv: {self.exe} does not exist (build the venv with "
                               "/work/shared/tools/vllm-cpu-venv.sh or pass its path)")
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        env = dict(os.environ, VLLM_TARGET_DEVICE="cpu",
                   VLLM_CPU_KVCACHE_SPACE=str(int(self.kv_space_gib)), PYTHONUNBUFFERED="1",
                   **self.extra_env)
        env.pop("VIRTUAL_ENV", None)
        self._log = tempfile.NamedTemporaryFile("w+", prefix="vllm-serve-", suffix=".log",
                                                delete=False)
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        code = self.proc.poll()
        tail = self.log_tail()
        self.stop()
        why = (f"exited with code {code}" if code is not None
               else f"did not answer /health within {self.start_timeout:g} s")
        raise RuntimeError(f"vllm serve {why}: {' '.join(self.args)}\n{tail}")

    def stop(self, grace: float = 30.0) -> Optional[int]:
        """SIGTERM to its process group (API server, engine core, workers), SIGKILL after
        ``grace`` seconds; removes the log. Idempotent."""
        if self.proc is not None:
            if self.proc.poll() is None:
                try:
                    os.killpg(self.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
                try:
                    self.proc.wait(grace)
                except subprocess.TimeoutExpired:
                    pass
            try:  # children that outlive the API server (engine core, workers)
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if self.proc.poll() is None:
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            try:
                os.unlink(self._log.name)
            except OSError:
                pass
            self._log = None
        return self.proc.returncode if self.proc is not None else None

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def model_vocab(model_dir: str) -> Optional[int]:
    """``vocab_size`` of a Hugging Face checkpoint's ``config.json`` (its text config's for a
    multimodal one); None when it has none."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    v = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    return int(v) if v else None


def _median(xs: list) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _min(xs: list) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return min(xs) if xs else None


def summarize(runs: list[dict]) -> dict:
    """One side's figures over its runs (module docstring)."""
    ok = [r for r in runs if "error" not in r]
    tput = [r["output_throughput"] for r in ok]
    ttft = [r["ttft_ms_median"] for r in ok]
    tpot = [r["tpot_ms_median"] for r in ok]
    return {
        "runs": runs,
        "output_throughput_min": min(tput) if tput else None,
        "output_throughput_median": _median(tput),
        "ttft_ms_min": _min(ttft),
        "ttft_ms_median": _median(ttft),
        "tpot_ms_min": _min(tpot),
        "tpot_ms_median": _median(tpot),
        "itl_ms_median": _median([r["itl_ms_median"] for r in ok]),
        "rss_bytes_peak_median": _median([r.get("rss_bytes_peak") for r in ok]),
        # the server's own latency (bench serve's server_*_us_*; None for vLLM's server) and
        # vLLM's own stages (None for ours)
        **{k: _median([r.get(k) for r in ok])
           for k in ("server_overhead_us_median", "server_overhead_us_p99",
                     "server_emit_us_median", "server_emit_us_p99",
                     "server_pickup_us_median", "server_queue_us_median",
                     "server_first_step_us_median", "server_ttft_us_median",
                     "vllm_queue_ms_mean", "vllm_prefill_ms_mean", "vllm_steps",
                     "engine_steps", "engine_step_ms_mean", "engine_step_cpu_ms_mean",
                     "engine_step_cpu_over_wall", "engine_thread_cpu_over_wall",
                     "engine_thread_runqueue_over_wall",
                     "server_cpu_ms_per_output_token",
                     "client_cpu_s", "other_cpu_s", "send_lag_ms_p99",
                     "client_loop_lag_ms_p99")},
        "idle_server_cpu_s_max": _max([r.get("idle_server_cpu_s") for r in ok]),
        "failures": sum(r["failures"] for r in ok),
    }


def _max(xs: list) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return max(xs) if xs else None


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def parse_env(items: list[str]) -> dict[str, str]:
    """``KEY=VALUE`` strings (``--vllm-env``) as a dict; anything else is a ValueError naming
    the option."""
    env: dict[str, str] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key or not key.replace("_", "a").isalnum():
            raise ValueError(f"--vllm-env takes KEY=VALUE (an environment variable for vllm "
                             f"serve), got {item!r}")
        env[key] = value
    return env


#: the sides of a comparison, in the order of an even round: ours as ``xllm-vmm serve`` runs it
#: (the headline), ours with the weights in the pool too (``--enable_vmm_weights=true``), vLLM
SIDES = ("xllm_vmm", "xllm_vmm_vmm_weights", "vllm")
#: what the second side of ours adds to serve's arguments
VMM_WEIGHTS_FLAG = "--enable_vmm_weights=true"
ORDERS = ("alternate", "fixed")


def round_order(sides: tuple[str, ...], i: int, order: str) -> tuple[str, ...]:
    """The sides in the order round ``i`` drives them: ``alternate`` reverses every odd round
    (ours first in even rounds, vLLM first in odd ones; a middle side stays in the middle),
    ``fixed`` keeps the even rounds' order in every round."""
    return tuple(reversed(sides)) if order == "alternate" and i % 2 else sides


def _check_compare_options(rounds: int, kv_space_gib: int, warmup_prompts: int, order: str,
                           residency: str) -> None:
    """``ValueError`` naming the option of :func:`compare` that is out of range."""
    if not 1 <= rounds <= 20:
        raise ValueError(f"--rounds must be in 1..20, got {rounds}")
    if kv_space_gib != int(kv_space_gib) or not 1 <= kv_space_gib <= 1024:
        # vLLM reads VLLM_CPU_KVCACHE_SPACE as an integer (0.5 fails its config validation)
        raise ValueError(f"--vllm-kv-space must be a whole number of GiB in 1..1024, got "
                         f"{kv_space_gib}")
    if not 0 <= warmup_prompts <= 100_000:
        raise ValueError(f"--warmup-prompts must be in 0..100000, got {warmup_prompts}")
    if order not in ORDERS:
        raise ValueError(f"--order must be one of {', '.join(ORDERS)}, got {order!r}")
    if residency not in RESIDENCIES:
        raise ValueError(f"--residency must be one of {', '.join(RESIDENCIES)}, got "
                         f"{residency!r}")


class _Comparison:
    """The servers of one :func:`compare` and what their runs gave: per side its measured
    runs, warm-ups and start-up times; for ours the exit code and start-up compute paths; for
    vLLM the error that ended its side, if one did."""

    def __init__(self, sides: tuple[str, ...], our_args: dict[str, list[str]], new_vllm,
                 warm: Optional[LoadConfig], settle_s: float, pause_idle: bool) -> None:
        self.sides, self.our_args, self.new_vllm = sides, our_args, new_vllm
        self.warm, self.settle_s, self.pause_idle = warm, settle_s, pause_idle
        self.runs: dict[str, list[dict]] = {side: [] for side in sides}
        self.warmups: dict[str, list[dict]] = {side: [] for side in sides}
        self.startups: dict[str, list[float]] = {side: [] for side in sides}
        self.vllm_error: Optional[str] = None
        self.vs: VllmServer = new_vllm()
        self.up: dict[str, object] = {}  # side -> its running server (ServerProcess / VllmServer)
        self.our_exit: dict[str, Optional[int]] = {}
        self.our_paths: dict[str, Optional[dict]] = {}  # side -> its start-up compute-paths line

    def start(self, side: str) -> bool:
        """Start ``side``'s server (timed into ``startups``); False when vLLM's fails (its
        error recorded). Ours failing raises: there is nothing to compare then."""
        t0 = time.monotonic()
        if side == "vllm":
            self.vs = self.new_vllm() if self.vs.proc is not None else self.vs
            try:
                self.vs.start()
            except RuntimeError as exc:
                self.vllm_error = str(exc)
                return False
            self.up[side] = self.vs
        else:
            self.up[side] = ServerProcess(list(self.our_args[side])).start()
        self.startups[side].append(time.monotonic() - t0)
        return True

    def stop(self, side: str) -> None:
        srv = self.up.pop(side, None)
        if srv is None:
            return
        code = srv.stop()
        if side != "vllm" and self.our_exit.get(side) in (None, 0):  # the first failing exit stays
            self.our_exit[side] = code
        if side != "vllm" and self.our_paths.get(side) is None:
            self.our_paths[side] = next((p for p in map(parse_paths_line, srv.log) if p), None)

    def run_one(self, side: str, load: LoadConfig, rss: bool) -> Optional[dict]:
        """One load on ``side``, the other servers up paused (``pause_idle``); None (and
        vLLM's error recorded) when vLLM failed."""
        srv = self.up[side]
        idle = [v.pid for k, v in self.up.items() if k != side and v.pid is not None]
        used_mem = host_memory_used_bytes()
        idle0 = [tree_cpu_seconds(p) for p in idle]
        paused = [p for p in idle if self.pause_idle and signal_tree(p, signal.SIGSTOP) > 0]
        try:
            out = run_load(drive(srv.url, load, rss_pid=srv.pid if rss else None))
        except Exception as exc:  # noqa: BLE001
            if side != "vllm":
                raise
            self.vllm_error = (f"the load failed on vllm serve: {type(exc).__name__}: {exc}\n"
                               f"{self.vs.log_tail(30)}")
            self.stop("vllm")
            return None
        finally:
            for p in paused:
                signal_tree(p, signal.SIGCONT)
        idle1 = [tree_cpu_seconds(p) for p in idle]
        used = [b - a for a, b in zip(idle0, idle1) if a is not None and b is not None]
        out["resident_servers"] = 1 + len(idle)
        out["host_memory_used_bytes_start"] = used_mem
        out["idle_server_cpu_s"] = sum(used) if idle else None
        out["idle_server_paused"] = bool(idle) and len(paused) == len(idle)
        return out

    def warm_up(self, side: str) -> None:
        """The warm-up load on ``side`` (when there is one), then ``settle_s``."""
        if self.warm is None:
            return
        w = self.run_one(side, self.warm, rss=False)
        if w is not None:
            self.warmups[side].append(w)
        time.sleep(self.settle_s)

    def measure(self, side: str, i: int, load: LoadConfig) -> None:
        out = self.run_one(side, load, rss=True)
        if out is not None:
            out["round"] = i
            self.runs[side].append(out)

    def run_shared(self, loads: list[LoadConfig], order: str) -> None:
        """Every server up for the whole comparison, the idle ones paused."""
        for side in self.sides:  # one at a time, each idle while the next starts
            self.start(side)
        for side in self.sides:
            if side in self.up:
                self.warm_up(side)
        for i, load in enumerate(loads):
            for side in round_order(self.sides, i, order):
                if side in self.up:
                    self.measure(side, i, load)
                    time.sleep(self.settle_s)

    def run_exclusive(self, loads: list[LoadConfig], order: str) -> None:
        """One server on the machine at a time: each run starts, warms up, measures and
        stops its server."""
        for i, load in enumerate(loads):
            for side in round_order(self.sides, i, order):
                if side == "vllm" and self.vllm_error is not None or not self.start(side):
                    continue
                try:
                    self.warm_up(side)
                    if side in self.up:
                        self.measure(side, i, load)
                finally:
                    self.stop(side)
                time.sleep(self.settle_s)

    def close(self) -> None:
        for side in list(self.up):
            self.stop(side)
        self.vs.stop()

    def summary(self, kv_space_gib: int, vllm_env: Optional[dict[str, str]]) -> dict:
        """Per side: :func:`summarize` of its runs, its warm-up and start-ups; vLLM's command,
        environment, reserved KV and error; ours' exit code, compute paths and command."""
        summary = {side: summarize(self.runs[side]) for side in self.sides}
        for side in self.sides:
            summary[side]["warmup"] = self.warmups[side][0] if self.warmups[side] else None
            summary[side]["startups"] = len(self.startups[side])
            summary[side]["startup_s_median"] = _median(self.startups[side])
        b = summary["vllm"]
        b["server"] = " ".join(self.vs.args) if self.vs.url else None
        b["env"] = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(int(kv_space_gib)),
                    **(vllm_env or {})}
        b["kv_reserved_bytes"] = int(kv_space_gib) << 30
        if self.vllm_error is not None:
            b["error"] = self.vllm_error
        for side in self.our_args:
            summary[side]["server_exit_code"] = self.our_exit.get(side)
            summary[side]["compute_paths"] = self.our_paths.get(side)
            summary[side]["server"] = "xllm-vmm serve " + " ".join(self.our_args[side])
        return summary


def compare(cfg: LoadConfig, serve_args: list[str], vllm_venv: str, *, rounds: int = 3,
            kv_space_gib: int = 2, vllm_start_timeout: float = 300.0,
            warmup_prompts: int = 32, vllm_env: Optional[dict[str, str]] = None,
            settle_s: float = 1.0, pause_idle: bool = True, vmm_weights_side: bool = False,
            order: str = "alternate", residency: str = "exclusive") -> dict:
    """The same warm-up, then ``rounds`` alternating rounds (module docstring), with one
    server up at a time (``residency="exclusive"``: each run starts its server, warms it up,
    measures it and stops it) or all of them up and the idle ones paused (``"shared"``).
    ``serve_args`` are ``xllm-vmm serve``'s (:func:`xllm_vmm.bench.serve.serve_args`: they
    name the model, dtype and context vLLM gets too). ``vmm_weights_side`` (off by default):
    a second server of ours with :data:`VMM_WEIGHTS_FLAG` added runs beside them (side
    ``xllm_vmm_vmm_weights``), unless ``serve_args`` already set ``enable_vmm_weights``.
    Off by default (its runs take time). With ``residency="shared"`` it is one more paused
    server's memory beside the headline, which slowed the headline's page commits
    (:mod:`xllm_vmm.bench.residency`: the headline falls behind in later rounds).
    ``order``: one of :data:`ORDERS` (:func:`round_order`). A vLLM start that fails ends
    vLLM's side with its ``error`` (the exact message and log tail), and so does a load that
    fails on it; our rounds still run."""
    _check_compare_options(rounds, kv_space_gib, warmup_prompts, order, residency)
    cfg.check()
    model = _flag_value(serve_args, "model")
    if model is None:
        raise ValueError("bench serve --vllm-venv needs the model's directory (serve's --model)")
    max_len = _flag_value(serve_args, "max_model_len")
    dtype = _flag_value(serve_args, "dtype")
    if dtype in (None, "auto"):
        dtype = "bfloat16"
    if cfg.vocab is None:
        cfg.vocab = model_vocab(model)  # the same token ids for both: vLLM's /v1/models has none
    loads = [replace(cfg, seed=cfg.seed + i) for i in range(rounds)]
    warm = (replace(cfg, seed=cfg.seed + WARMUP_SEED_OFFSET, num_prompts=warmup_prompts)
            if warmup_prompts else None)
    with_vw = vmm_weights_side and _flag_value(serve_args, "enable_vmm_weights") is None
    sides = SIDES if with_vw else (SIDES[0], SIDES[2])
    our_args = {"xllm_vmm": list(serve_args)}
    if with_vw:
        our_args["xllm_vmm_vmm_weights"] = [*serve_args, VMM_WEIGHTS_FLAG]

    def new_vllm() -> VllmServer:
        return VllmServer(vllm_venv, model, dtype=dtype,
                          max_model_len=int(max_len) if max_len else None,
                          kv_space_gib=kv_space_gib, start_timeout=vllm_start_timeout,
                          env=vllm_env)

    cmp = _Comparison(sides, our_args, new_vllm, warm, settle_s, pause_idle)
    try:
        if residency == "shared":
            cmp.run_shared(loads, order)
        else:
            cmp.run_exclusive(loads, order)
    finally:
        cmp.close()
    summary = cmp.summary(kv_space_gib, vllm_env)
    out = {
        "num_prompts": cfg.num_prompts, "input_len": cfg.input_len,
        "range_ratio": cfg.range_ratio, "output_len": cfg.output_len,
        "request_rate": cfg.request_rate if cfg.request_rate != float("inf") else "inf",
        "seed": cfg.seed, "rounds": rounds, "warmup_prompts": warmup_prompts, "order": order,
        "residency": residency, "cpu_model": caps().model,
        **summary,
    }
    for side, suffix in (("xllm_vmm", ""), ("xllm_vmm_vmm_weights", "_vmm_weights")):
        if side in summary:
            out.update(_ratios(summary[side], summary["vllm"], cmp.runs[side], cmp.runs["vllm"],
                               suffix))
    return out


def _ratios(a: dict, b: dict, ours: list[dict], theirs: list[dict], suffix: str) -> dict:
    """``vs_vllm_{throughput,ttft,tpot}_ratio{suffix}`` (medians over rounds: ours / vLLM's)
    and the same per round (``..._per_round{suffix}``: the pairs of the same round), plus
    ``vs_vllm_cpu_per_token_ratio{suffix}`` (the server's CPU per output token, medians)."""
    by_round = {r["round"]: r for r in theirs}
    pairs = [(x, by_round[x["round"]]) for x in ours if x["round"] in by_round]

    def per_round(key: str) -> list:
        return [_ratio(x.get(key), y.get(key)) for x, y in pairs]

    return {
        f"vs_vllm_throughput_ratio{suffix}": _ratio(a["output_throughput_median"],
                                                   b["output_throughput_median"]),
        f"vs_vllm_ttft_ratio{suffix}": _ratio(a["ttft_ms_median"], b["ttft_ms_median"]),
        f"vs_vllm_tpot_ratio{suffix}": _ratio(a["tpot_ms_median"], b["tpot_ms_median"]),
        f"vs_vllm_cpu_per_token_ratio{suffix}": _ratio(
            a["server_cpu_ms_per_output_token"],
            b["server_cpu_ms_per_output_token"]),
        f"vs_vllm_throughput_ratio_per_round{suffix}": per_round("output_throughput"),
        f"vs_vllm_ttft_ratio_per_round{suffix}": per_round("ttft_ms_median"),
        f"vs_vllm_tpot_ratio_per_round{suffix}": per_round("tpot_ms_median"),
    }


def flat(result: dict) -> dict:
    """:func:`compare`'s figures for a table: the scalars, each side's summary as
    ``side.key`` (runs left out: ``--format json`` has them)."""
    out: dict = {}
    for k, v in result.items():
        if isinstance(v, dict):
            for kk, vv in v.items():
                if kk not in ("runs", "warmup"):
                    out[f"{k}.{kk}"] = vv
        else:
            out[k] = v
    return out
