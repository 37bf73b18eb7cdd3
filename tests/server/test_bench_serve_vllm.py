"""``bench serve --vllm-venv``: vLLM's server side by side with ours under the same load.

vLLM itself is not installed in the test environment; a stand-in ``VENV/bin/vllm`` (a script
that serves the engine double over this project's HTTP app, and records its command line and
environment) checks the orchestration: the command and environment vLLM gets, readiness by
``/health``, interleaved rounds with one server at a time, the figures, and a failed start
reported with its exact message while our side still runs. With ``XLLM_VMM_TEST_VLLM_VENV``
naming a real venv (``/work/shared/tools/vllm-cpu-venv.sh``), one more test runs the real one.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.server.conftest import FakeEngine
from xllm_vmm.bench import serve as bs
from xllm_vmm.bench.proctree import process_children
from xllm_vmm.bench import serve_compare as sc
from xllm_vmm.server import AsyncEngine, RunningServer, ServerSettings, build_app

REPO = Path(__file__).resolve().parents[2]

FAKE_VLLM = """\
#!{python}
# A stand-in for vLLM's `vllm serve`: the engine double behind this project's HTTP app.
import json, os, signal, sys, time
sys.path.insert(0, {repo!r})
argv = sys.argv[1:]
assert argv[0] == "serve", argv
model = argv[1]
opts = dict(zip(argv[2::2], argv[3::2]))
with open({record!r}, "a") as fh:
    fh.write(json.dumps({{"argv": argv, "pid": os.getpid(), "t": time.time(),
        "env": {{k: os.environ.get(k) for k in ("VLLM_TARGET_DEVICE",
                                               "VLLM_CPU_KVCACHE_SPACE",
                                               "VLLM_CPU_OMP_THREADS_BIND")}}}}) + "\\n")
if {fail!r}:
    print("RuntimeError: Engine core initialization failed. See root cause above.",
          flush=True)
    sys.exit(3)
from tests.server.conftest import FakeEngine
from xllm_vmm.engine.tokenizer import Tokenizer
from xllm_vmm.server import AsyncEngine, RunningServer, ServerSettings, build_app
eng = FakeEngine(Tokenizer.from_dir(model), max_model_len=int(opts["--max-model-len"]),
                 name=model)
srv = RunningServer(build_app(AsyncEngine(eng), ServerSettings()), port=int(opts["--port"]))
signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGTERM}})
srv.start()
signal.sigwait({{signal.SIGTERM}})
srv.stop()
"""


def _venv(tmp_path: Path, fail: bool = False) -> tuple[Path, Path]:
    venv = tmp_path / ("venv-fail" if fail else "venv")
    (venv / "bin").mkdir(parents=True)
    record = tmp_path / ("record-fail.jsonl" if fail else "record.jsonl")
    exe = venv / "bin" / "vllm"
    exe.write_text(FAKE_VLLM.format(python=sys.executable, repo=str(REPO), record=str(record),
                                    fail=fail))
    exe.chmod(0o755)
    return venv, record


def test_flag_value_reads_serve_args():
    args = ["--model", "/m", "--max-model-len=513", "--dtype", "float32", "--max_model_len=600"]
    assert sc._flag_value(args, "model") == "/m"
    assert sc._flag_value(args, "max_model_len") == "600"  # the last wins, either spelling
    assert sc._flag_value(args, "dtype") == "float32"
    assert sc._flag_value(args, "port") is None


def test_tree_rss_counts_children():
    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(64 << 20); "
                              "b[::4096] = b'x' * len(b[::4096]); time.sleep(30)"])
    try:
        time.sleep(1.0)
        alone = bs.tree_rss_bytes(child.pid)
        mine = bs.tree_rss_bytes(os.getpid())
        assert alone is not None and alone > 64 << 20
        assert mine is not None and mine >= alone  # this process's tree includes the child
    finally:
        child.kill()
        child.wait()
    assert bs.tree_rss_bytes(child.pid) is None


def test_same_seed_same_prompts_on_two_servers(tokenizer):
    """Two servers under one LoadConfig see the same prompts and budgets (the comparison's
    premise), whatever vocabulary either reports: ``vocab`` fixes the id range."""
    seen = []
    for name in ("a", "b"):
        eng = FakeEngine(tokenizer, max_model_len=256, name=name)
        added = []
        orig = eng.add_request

        def add(rid, ids, params, arrival_time=None, _o=orig, _a=added):
            _a.append((tuple(ids), params.max_tokens))
            return _o(rid, ids, params, arrival_time)

        eng.add_request = add
        with RunningServer(build_app(AsyncEngine(eng), ServerSettings())) as srv:
            cfg = bs.LoadConfig(num_prompts=8, request_rate=500.0, input_len=20, output_len=3,
                                vocab=200)
            out = asyncio.run(bs.drive(srv.url, cfg))
        assert out["completed"] == 8
        seen.append(sorted(added[1:]))  # the first one is the warm-up
    assert seen[0] == seen[1]
    assert all(4 <= t < 200 for ids, _ in seen[0] for t in ids)


def test_vllm_server_missing_and_failing(tmp_path, tiny_llama_dir):
    with pytest.raises(RuntimeError, match="does not exist"):
        sc.VllmServer(tmp_path / "nothing", str(tiny_llama_dir)).start()
    venv, record = _venv(tmp_path, fail=True)
    srv = sc.VllmServer(venv, str(tiny_llama_dir), max_model_len=100, start_timeout=60)
    with pytest.raises(RuntimeError) as err:
        srv.start()
    msg = str(err.value)
    assert "exited with code 3" in msg and "Engine core initialization failed" in msg
    assert "--max-model-len 100" in msg
    assert srv._log is None  # the log is removed


def test_compare_warms_both_then_alternates_rounds(tmp_path, tiny_llama_dir):
    """Both servers stay up; each gets the same warm-up load (not counted), then every round
    drives both with that round's own prompts (the same for both sides), one server at a time,
    the order alternating; ratios per round pair the same round."""
    venv, record = _venv(tmp_path)
    cfg = bs.LoadConfig(num_prompts=6, request_rate=float("inf"), input_len=12, output_len=8,
                        timeout=120, seed=5)
    args = bs.serve_args(str(tiny_llama_dir), ["--device-memory=256MiB"], 12, 0.5, 8)
    t0 = time.time()
    out = sc.compare(cfg, args, str(venv), rounds=3, kv_space_gib=1, warmup_prompts=4,
                     vllm_env={"VLLM_CPU_OMP_THREADS_BIND": "0"}, settle_s=0.0,
                     vmm_weights_side=True, residency="shared")
    starts = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(starts) == 1 and starts[0]["t"] > t0  # one vLLM start for all rounds
    assert out["residency"] == "shared"
    assert out["cpu_model"] and out["xllm_vmm"]["compute_paths"]["cpu_model"] == out["cpu_model"]
    r = starts[0]
    assert r["env"] == {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
                        "VLLM_CPU_OMP_THREADS_BIND": "0"}  # --vllm-env reaches it
    argv = r["argv"]
    assert argv[:2] == ["serve", str(tiny_llama_dir)]
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    assert argv[argv.index("--max-model-len") + 1] == sc._flag_value(args, "max_model_len")
    assert bs.tree_rss_bytes(r["pid"]) is None  # stopped
    assert out["vllm"]["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert out["order"] == "alternate"
    # ours as serve runs it (the headline) and ours with the weights in the pool too
    assert "--enable_vmm_weights=true" not in out["xllm_vmm"]["server"]
    assert out["xllm_vmm_vmm_weights"]["server"].endswith(" --enable_vmm_weights=true")
    for side in sc.SIDES:
        s = out[side]
        assert [x["round"] for x in s["runs"]] == [0, 1, 2]
        assert [x["seed"] for x in s["runs"]] == [5, 6, 7]  # new prompts every round
        assert s["warmup"]["completed"] == 4 and s["warmup"]["seed"] == 5 + sc.WARMUP_SEED_OFFSET
        assert len(s["runs"]) == 3 and s["failures"] == 0, s
        assert all(x["completed"] == 6 and x["total_output_tokens"] == 48 for x in s["runs"])
        assert s["output_throughput_min"] <= s["output_throughput_median"]
        assert s["ttft_ms_min"] <= s["ttft_ms_median"] and s["tpot_ms_min"] <= s["tpot_ms_median"]
        assert s["rss_bytes_peak_median"] > 10 << 20
        if side != "vllm":  # ours record what each part of the engine took
            assert {"bf16_compute", "layer_ops", "attention_decode"} <= set(s["compute_paths"])
        assert s["ttft_ms_median"] > 0 and s["tpot_ms_median"] > 0
        # the other server was idle while this one ran (a few scheduler ticks at most)
        assert all(x["idle_server_cpu_s"] is not None and x["idle_server_cpu_s"] < 1.0
                   for x in s["runs"])
        assert all(x["idle_server_paused"] is True for x in s["runs"])  # stopped, then resumed
        assert all(x["resident_servers"] == 3 for x in s["runs"])
        assert s["startups"] == 1 and s["startup_s_median"] > 0
        # every side's tree from /proc (clock ticks: a fake server's few tokens may read 0)
        assert s["server_cpu_ms_per_output_token"] is not None
        assert s["server_cpu_ms_per_output_token"] >= 0
    assert sum(out[side]["server_cpu_ms_per_output_token"] for side in sc.SIDES) > 0
    assert out["xllm_vmm"]["server_exit_code"] == 0
    assert out["xllm_vmm_vmm_weights"]["server_exit_code"] == 0
    assert "error" not in out["vllm"] and out["vllm"]["kv_reserved_bytes"] == 1 << 30
    assert out["vs_vllm_throughput_ratio"] == pytest.approx(
        out["xllm_vmm"]["output_throughput_median"] / out["vllm"]["output_throughput_median"])
    for side, suffix in (("xllm_vmm", ""), ("xllm_vmm_vmm_weights", "_vmm_weights")):
        for key, field in (("throughput", "output_throughput"), ("ttft", "ttft_ms_median"),
                           ("tpot", "tpot_ms_median")):
            per = out[f"vs_vllm_{key}_ratio_per_round{suffix}"]
            assert per == [pytest.approx(a[field] / b[field]) for a, b in
                           zip(out[side]["runs"], out["vllm"]["runs"])]
        theirs = out["vllm"]["server_cpu_ms_per_output_token"]
        if theirs:  # a fake server's few tokens can read 0 clock ticks: no ratio then
            assert out[f"vs_vllm_cpu_per_token_ratio{suffix}"] == pytest.approx(
                out[side]["server_cpu_ms_per_output_token"] / theirs)
        else:
            assert out[f"vs_vllm_cpu_per_token_ratio{suffix}"] is None
    flat = sc.flat(out)
    assert "xllm_vmm.output_throughput_median" in flat and "vllm.runs" not in flat
    assert "vllm.warmup" not in flat


def test_compare_alternates_which_server_goes_first(tmp_path, tiny_llama_dir, monkeypatch):
    venv, _ = _venv(tmp_path)
    seen: list[tuple[str, int]] = []
    real = sc.drive

    async def spy(url, load, **kw):
        seen.append((url, load.seed))
        return await real(url, load, **kw)

    monkeypatch.setattr(sc, "drive", spy)
    cfg = bs.LoadConfig(num_prompts=3, request_rate=float("inf"), input_len=12, output_len=4,
                        timeout=120)
    args = bs.serve_args(str(tiny_llama_dir), ["--device-memory=256MiB"], 12, 0.5, 4)
    out = sc.compare(cfg, args, str(venv), rounds=3, kv_space_gib=1, warmup_prompts=2,
                     settle_s=0.0, vmm_weights_side=True, residency="shared")
    names = dict(zip([url for url, _ in seen[:3]], ("ours", "ours_vw", "vllm")))
    assert [names[url] for url, _ in seen] == [
        "ours", "ours_vw", "vllm",                                # warm-up, each alone
        "ours", "ours_vw", "vllm", "vllm", "ours_vw", "ours", "ours", "ours_vw", "vllm"]
    assert [seed for _, seed in seen] == [1000] * 3 + [0] * 3 + [1] * 3 + [2] * 3
    assert out["xllm_vmm_vmm_weights"]["runs"][0]["idle_server_paused"] is True  # both others
    # the same order every round, and without the second server of ours
    seen.clear()
    out = sc.compare(cfg, args, str(venv), rounds=2, kv_space_gib=1, warmup_prompts=0,
                     settle_s=0.0, vmm_weights_side=False, order="fixed", residency="shared")
    assert "xllm_vmm_vmm_weights" not in out and "vs_vllm_tpot_ratio_vmm_weights" not in out
    assert out["order"] == "fixed" and len(seen) == 4
    assert [url for url, _ in seen][::2] == [seen[0][0]] * 2  # ours first in both rounds


def test_compare_exclusive_runs_one_server_on_the_machine_at_a_time(tmp_path, tiny_llama_dir,
                                                                     monkeypatch):
    """The default residency: every run starts its side's server, warms it up, measures it
    and stops it, so that no other server's memory is resident while one is measured (an
    idle vLLM's slowed our elastic KV cache's page commits: docs/benchmarks.md)."""
    venv, record = _venv(tmp_path)
    seen: list[tuple[str, int, list[int]]] = []
    real = sc.drive

    async def spy(url, load, **kw):
        children = (process_children() or {}).get(os.getpid(), [])
        live = [c for c in children if bs.tree_rss_bytes(c) is not None]
        seen.append((url, load.seed, live))
        return await real(url, load, **kw)

    monkeypatch.setattr(sc, "drive", spy)
    cfg = bs.LoadConfig(num_prompts=3, request_rate=float("inf"), input_len=12, output_len=4,
                        timeout=120, seed=7)
    args = bs.serve_args(str(tiny_llama_dir), ["--device-memory=256MiB"], 12, 0.5, 4)
    out = sc.compare(cfg, args, str(venv), rounds=2, kv_space_gib=1, warmup_prompts=2,
                     settle_s=0.0)
    assert out["residency"] == "exclusive"
    starts = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(starts) == 2  # vLLM started for each of its runs...
    assert all(bs.tree_rss_bytes(r["pid"]) is None for r in starts)  # ...and stopped after
    vllm_urls = {f"http://127.0.0.1:{r['argv'][r['argv'].index('--port') + 1]}" for r in starts}
    side = ["vllm" if url in vllm_urls else "ours" for url, _, _ in seen]
    # each start: its warm-up, then its measured run; ours first in round 0, vLLM in round 1
    assert side == ["ours", "ours", "vllm", "vllm", "vllm", "vllm", "ours", "ours"]
    assert [seed for _, seed, _ in seen] == [1007, 7, 1007, 7, 1007, 8, 1007, 8]
    assert len({url for url, _, _ in seen}) == 4  # a new server (and port) every run
    assert all(len(live) == 1 for _, _, live in seen)  # only the driven server is up
    for s in (out["xllm_vmm"], out["vllm"]):
        assert [x["round"] for x in s["runs"]] == [0, 1] and s["failures"] == 0
        assert s["startups"] == 2 and s["startup_s_median"] > 0
        assert s["warmup"]["completed"] == 2
        for x in s["runs"]:
            assert x["completed"] == 3 and x["resident_servers"] == 1
            assert x["idle_server_cpu_s"] is None and x["idle_server_paused"] is False
            assert x["host_memory_used_bytes_start"] > 0
    assert out["xllm_vmm"]["server_exit_code"] == 0
    assert out["vs_vllm_tpot_ratio_per_round"] == [
        pytest.approx(a["tpot_ms_median"] / b["tpot_ms_median"])
        for a, b in zip(out["xllm_vmm"]["runs"], out["vllm"]["runs"])]
    assert [p for p in (process_children() or {}).get(os.getpid(), [])
            if bs.tree_rss_bytes(p) is not None] == []  # nothing left behind


def test_round_order():
    assert sc.round_order(sc.SIDES, 0, "alternate") == sc.SIDES
    assert sc.round_order(sc.SIDES, 1, "alternate") == tuple(reversed(sc.SIDES))
    assert sc.round_order(sc.SIDES, 1, "fixed") == sc.SIDES
    assert sc.round_order(("a", "b"), 3, "alternate") == ("b", "a")


def test_parse_env():
    assert sc.parse_env(["A=1", "B_C=x=y", "D="]) == {"A": "1", "B_C": "x=y", "D": ""}
    for bad in ("A", "=1", "A B=1"):
        with pytest.raises(ValueError, match="--vllm-env"):
            sc.parse_env([bad])


def test_tree_cpu_seconds_counts_children():
    child = subprocess.Popen([sys.executable, "-c",
                              "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.6: pass\ntime.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while (bs.tree_cpu_seconds(child.pid) or 0) < 0.5 and time.monotonic() < deadline:
            time.sleep(0.1)
        alone = bs.tree_cpu_seconds(child.pid)
        assert alone is not None and alone >= 0.5
        assert bs.tree_cpu_seconds(os.getpid()) >= alone  # this process's tree includes it
    finally:
        child.kill()
        child.wait()
    assert bs.tree_cpu_seconds(child.pid) is None


def _state(pid):
    with open(f"/proc/{pid}/stat", "rb") as fh:
        return fh.read().rpartition(b")")[2].split()[0].decode()


def test_signal_tree_pauses_and_resumes_a_process_and_its_children():
    # a parent that starts a busy child: both stop on SIGSTOP (state T) and run again on SIGCONT
    parent = subprocess.Popen([sys.executable, "-c",
                               "import subprocess, sys, time\n"
                               "c = subprocess.Popen([sys.executable, '-c', 'while True: pass'])\n"
                               "print(c.pid, flush=True)\ntime.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert set(bs.tree_pids(parent.pid)) == {parent.pid, child}
        assert bs.signal_tree(parent.pid, signal.SIGSTOP) == 2
        deadline = time.monotonic() + 10
        while {_state(parent.pid), _state(child)} != {"T"} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _state(parent.pid) == _state(child) == "T"
        busy = bs.tree_cpu_seconds(child)
        time.sleep(0.3)
        assert bs.tree_cpu_seconds(child) == busy  # a stopped tree uses no CPU
        assert bs.signal_tree(parent.pid, signal.SIGCONT) == 2
        deadline = time.monotonic() + 10
        while bs.tree_cpu_seconds(child) == busy and time.monotonic() < deadline:
            time.sleep(0.05)
        assert bs.tree_cpu_seconds(child) > busy  # running again
    finally:
        for p in bs.tree_pids(parent.pid)[::-1]:
            os.kill(p, signal.SIGKILL)
        parent.wait()
    assert bs.tree_pids(parent.pid) == []


def test_vllm_stage_figures_read_its_histograms():
    def text(q_sum, q_n, p_sum, p_n, steps):
        rows = []
        for name, total, n in (("vllm:request_queue_time_seconds", q_sum, q_n),
                               ("vllm:request_prefill_time_seconds", p_sum, p_n)):
            lab = 'engine="0",model_name="m"'
            rows += [f'{name}_bucket{{{lab},le="0.1"}} {n}', f'{name}_bucket{{{lab},le="+Inf"}} {n}',
                     f"{name}_count{{{lab}}} {n}", f"{name}_sum{{{lab}}} {total}"]
        rows.append(f'vllm:iteration_tokens_total_count{{engine="0",model_name="m"}} {steps}')
        return "\n".join(rows)

    figs = bs.vllm_stage_figures(text(1.0, 10, 2.0, 10, 50), text(1.5, 20, 3.0, 20, 80))
    assert figs["vllm_queue_ms_mean"] == pytest.approx(50.0)
    assert figs["vllm_prefill_ms_mean"] == pytest.approx(100.0)
    assert figs["vllm_steps"] == 30
    assert bs.vllm_stage_figures("", "xllm_vmm_x 1") == {}  # ours has none


def test_compare_cli_keeps_our_side_when_vllm_fails(tmp_path, tiny_llama_dir):
    venv, record = _venv(tmp_path, fail=True)
    proc = subprocess.run(
        [sys.executable, "-m", "xllm_vmm.cli", "bench", "serve", "--model", str(tiny_llama_dir),
         "--vllm-venv", str(venv), "--rounds", "1", "--num-prompts", "4", "--request-rate",
         "inf", "--input-len", "12", "--output-len", "6", "--timeout", "120",
         "--serve-arg=--device-memory=256MiB", "--format", "json"],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["xllm_vmm"]["runs"][0]["completed"] == 4
    assert "xllm_vmm_vmm_weights" not in out  # the third server is opt-in (--vmm-weights-side)
    assert "Engine core initialization failed" in out["vllm"]["error"]
    assert out["vllm"]["runs"] == [] and out["vs_vllm_throughput_ratio"] is None
    assert out["vs_vllm_ttft_ratio_per_round"] == []


def test_compare_refuses_bad_options(tmp_path):
    cfg = bs.LoadConfig()
    with pytest.raises(ValueError, match="--rounds"):
        sc.compare(cfg, ["--model", "/m"], str(tmp_path), rounds=0)
    with pytest.raises(ValueError, match="--vllm-kv-space"):
        sc.compare(cfg, ["--model", "/m"], str(tmp_path), kv_space_gib=0)
    with pytest.raises(ValueError, match="whole number"):
        sc.compare(cfg, ["--model", "/m"], str(tmp_path), kv_space_gib=0.5)
    with pytest.raises(ValueError, match="--warmup-prompts"):
        sc.compare(cfg, ["--model", "/m"], str(tmp_path), warmup_prompts=-1)
    with pytest.raises(ValueError, match="--model"):
        sc.compare(cfg, [], str(tmp_path))
    with pytest.raises(ValueError, match="--order"):
        sc.compare(cfg, ["--model", "/m"], str(tmp_path), order="random")
    with pytest.raises(ValueError, match="--residency must be one of exclusive, shared"):
        sc.compare(cfg, ["--model", "/m"], str(tmp_path), residency="both")


@pytest.mark.skipif(not os.environ.get("XLLM_VMM_TEST_VLLM_VENV"),
                    reason="set XLLM_VMM_TEST_VLLM_VENV to a vLLM CPU venv to run the real one")
def test_real_vllm_side_by_side():
    # The bench Llama: vLLM's engine core failed on the tiny fp32 test Llama (head size 16).
    cfg = bs.LoadConfig(num_prompts=8, request_rate=float("inf"), input_len=16, output_len=8)
    args = bs.serve_args(None, ["--device-memory=1GiB"], 16, 0.5, 8)
    out = sc.compare(cfg, args, os.environ["XLLM_VMM_TEST_VLLM_VENV"], rounds=1,
                     kv_space_gib=1, warmup_prompts=4)
    assert "error" not in out["vllm"], out["vllm"].get("error")
    assert out["vllm"]["runs"][0]["completed"] == 8 and out["vs_vllm_throughput_ratio"] > 0
