"""The native kernels' threads (:mod:`xllm_vmm.engine.native_threads`): on torch's OpenMP team
by default, each library's own pool with ``XLLM_VMM_NATIVE_THREADS=pool``. Both give the same
results for every thread count (every tid runs once, also when the team is smaller than asked
for), the OpenMP mode starts no thread of its own, a forked child falls back to its own pool, and
a malformed setting is refused naming the variable."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from xllm_vmm.engine import native_threads as nt
from xllm_vmm.engine.attention import native_decode as nd
from xllm_vmm.engine.layers import layer_ops as lo

from tests.engine.test_native_decode import _case, _check

pytestmark = pytest.mark.skipif(nd.load() is None or lo.load() is None,
                                reason="the native kernel libraries are not built "
                                       "(python setup.py build_ext --inplace)")

needs_omp = pytest.mark.skipif(nt.openmp_entry_points() is None,
                               reason="torch's parallel backend here is not OpenMP")


@pytest.fixture
def restore_mode(monkeypatch):
    before = nt.mode()
    for var in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):  # a spinning runtime, as serve runs it
        monkeypatch.delenv(var, raising=False)
    yield
    monkeypatch.undo()
    nt.set_mode(before)


@needs_omp
def test_default_mode_is_torchs_openmp_team(monkeypatch):
    monkeypatch.delenv(nt.ENV, raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert nt.wanted() == "omp"
    assert nt.mode() == "omp"
    # the entry points are those of the runtime torch loaded, not a second copy
    maps = open("/proc/self/maps").read()
    assert sum(1 for p in {ln.split()[-1] for ln in maps.splitlines() if ".so" in ln}
               if os.path.basename(p).startswith(("libgomp", "libiomp5"))) == 1


@pytest.mark.parametrize("mode", ["omp", "pool"])
def test_decode_and_norms_are_the_same_on_both_thread_sources(mode, restore_mode):
    if mode == "omp" and nt.openmp_entry_points() is None:
        pytest.skip("torch's parallel backend here is not OpenMP")
    assert nt.set_mode(mode) == mode
    g = torch.Generator().manual_seed(5)
    arena, q, rows, table, lens_t, exp = _case(g, lens=[70, 1, 17, 33, 5, 48], H=8, HKV=2,
                                               D=64, dtype=torch.bfloat16, extra_rows=0)
    kw = dict(block_size=16, blocks_per_slot=arena.bps, scale=0.125, rows=rows)
    for n in (1, 2, 3, 5, 12):  # more tids than the team has threads: each still runs once
        _check(nd.paged_decode(q, arena.k, arena.v, table, lens_t, num_threads=n, **kw),
               exp, torch.bfloat16, ())
    # a norm large enough to be split over the threads (layer_ops.PARALLEL_MIN_ELEMS)
    x = torch.randn(700, 512, generator=g).to(torch.bfloat16)
    w = torch.randn(512, generator=g).to(torch.bfloat16)
    got = lo.rms_norm(x, w, 1e-6)
    ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
           * w.float()).to(torch.bfloat16)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=1e-2)


_THREADS_SCRIPT = textwrap.dedent("""
    import os, sys, torch
    from xllm_vmm.engine import native_threads as nt
    from xllm_vmm.engine.attention import native_decode as nd
    from tests.engine.test_native_decode import _case
    torch.set_num_threads(2)
    a = torch.randn(512, 512)
    for _ in range(3):
        a @ a  # torch's team exists now
    g = torch.Generator().manual_seed(3)
    arena, q, rows, table, lens_t, exp = _case(g, lens=[300] * 16, H=8, HKV=4, D=64,
                                               dtype=torch.bfloat16, extra_rows=0)
    before = len(os.listdir("/proc/self/task"))
    for _ in range(5):
        nd.paged_decode(q, arena.k, arena.v, table, lens_t, block_size=16,
                        blocks_per_slot=arena.bps, scale=0.125, rows=rows, num_threads=2)
    print(nt.mode(), len(os.listdir("/proc/self/task")) - before)
""")


@needs_omp
@pytest.mark.parametrize("mode,new_threads", [("omp", 0), ("pool", 1)])
def test_openmp_mode_starts_no_threads_of_its_own(mode, new_threads):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env[nt.ENV] = mode
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", _THREADS_SCRIPT], env=env, cwd=root,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [mode, str(new_threads)]


def test_a_malformed_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv(nt.ENV, "gomp")
    with pytest.raises(ValueError, match=r"XLLM_VMM_NATIVE_THREADS='gomp' \(environment\)"):
        nt.wanted()
    with pytest.raises(ValueError, match="expected one of omp, pool"):
        nt.set_mode("threads")


@needs_omp
@pytest.mark.parametrize("var,value", [("OMP_WAIT_POLICY", "PASSIVE"), ("GOMP_SPINCOUNT", "0")])
def test_a_passive_openmp_runtime_keeps_the_libraries_own_pools(var, value, restore_mode,
                                                                monkeypatch):
    """Told not to spin, the team sleeps after every region: each kernel would pay a wake-up,
    so the kernels keep their own pool (and the results do not change)."""
    monkeypatch.setenv(var, value)
    assert nt.openmp_passive()
    assert nt.set_mode("omp") == "pool" and nt.mode() == "pool"
    g = torch.Generator().manual_seed(9)
    arena, q, rows, table, lens_t, exp = _case(g, lens=[40, 9], H=4, HKV=2, D=64,
                                               dtype=torch.bfloat16, extra_rows=0)
    _check(nd.paged_decode(q, arena.k, arena.v, table, lens_t, block_size=16,
                           blocks_per_slot=arena.bps, scale=0.125, rows=rows, num_threads=2),
           exp, torch.bfloat16, ())
    monkeypatch.delenv(var)
    assert not nt.openmp_passive() and nt.set_mode("omp") == "omp"


_RELEASE_SCRIPT = textwrap.dedent("""
    import os, threading, torch
    from xllm_vmm.engine import native_threads as nt
    torch.set_num_threads(2)
    a = torch.randn(1024, 1024)
    big = torch.randn(1 << 22)  # at::parallel_for over 4M elements: always a 2-thread region
    ref = a @ a
    big_ref = big.exp()  # the main thread's OpenMP team exists now (BLAS may not thread a product)
    tasks = lambda: len(os.listdir("/proc/self/task"))
    with_team = tasks()
    released = nt.release_team()
    after = tasks()
    got = {}
    def other():  # another thread's team: the process's only one now
        got["y"] = a @ a
        got["e"] = big.exp()
        got["tasks"] = tasks()
    t = threading.Thread(target=other); t.start(); t.join()
    again = a @ a  # the main thread can still compute (a new team)
    print(released, with_team - after,
          bool(torch.equal(got["y"], ref) and torch.equal(got["e"], big_ref)),
          bool(torch.equal(again, ref)), got["tasks"] - after)
""")


@needs_omp
def test_release_team_ends_the_calling_threads_workers_and_torch_still_computes():
    """serve ends its main thread's team after loading: its idle worker exits (one thread
    fewer), another thread's products then run on that thread's own team (the caller plus one
    worker), with the same results, and the main thread can still compute afterwards."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT",
                                                            "OMP_NUM_THREADS")}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", _RELEASE_SCRIPT], env=env, cwd=root,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    # released; one worker fewer; same products; the other thread's team: itself + 1 worker
    assert r.stdout.split() == ["True", "1", "True", "True", "2"]
