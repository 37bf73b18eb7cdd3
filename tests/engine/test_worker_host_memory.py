"""glibc malloc tuning (``xllm_vmm.engine.host_memory``): with it, freed multi-MiB activations
stay in the heap and later steps reuse them without page faults, on the main thread and on an
engine thread of its own (``serve``), and a 24 MiB block comes from the heap; with
``XLLM_VMM_MALLOPT=0`` glibc's default path (that block mmapped) is kept.

Each case runs in a fresh interpreter: the setting is process-wide and cannot be undone."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")

_PROBE = r"""
import json, resource, sys
import torch
import torch.nn.functional as F
from xllm_vmm.engine import host_memory as hm
from xllm_vmm.engine.layers.linear import dense
tuned = hm.configure_host_malloc() if sys.argv[1] == "engine" else None
# a step's pattern: 4 layers of a 2,048-token gated MLP (bf16, intermediate 1,536), through
# the engine's own product (in float32 over upcasts where this CPU has no oneDNN bfloat16:
# torch's portable bfloat16 gemm there is ~6x slower and would outlast the timeout)
x = torch.ones(2048, 512, dtype=torch.bfloat16)
w1 = torch.full((3072, 512), 0.01, dtype=torch.bfloat16)
w2 = torch.full((512, 1536), 0.01, dtype=torch.bfloat16)
# before any free: glibc's default raises its mmap threshold to the largest chunk freed
before = hm.mallinfo2()
t = torch.empty(24 << 20, dtype=torch.uint8)  # below the tuned 32 MiB mmap threshold
during = hm.mallinfo2()
del t
faults = []
for r in range(10):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    h = x
    for layer in range(4):
        gu = dense(h, w1)
        g, u = gu.split(1536, -1)
        h = dense(F.silu(g) * u, w2) + h
        del gu, g, u
    del h
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(json.dumps({"tuned": None if tuned is None else tuned.__dict__,
                  "again": None if tuned is None else hm.configure_host_malloc().__dict__,
                  "mmapped_during": None if before is None else during["hblkhd"] - before["hblkhd"],
                  "faults": faults}))
"""


def _probe(mode: str, **env: str) -> dict:
    e = {k: v for k, v in os.environ.items() if k != "XLLM_VMM_MALLOPT"}
    e.update(env)
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True,
                         env=e, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if got["mmapped_during"] is None:
        pytest.skip("no mallinfo2")
    return got


def test_tuned_heap_reuses_freed_activations_without_faults():
    got = _probe("engine")
    assert got["tuned"]["applied"] is True, got["tuned"]
    assert got["tuned"]["mmap_threshold_bytes"] == 32 << 20
    assert got["again"] == got["tuned"]  # once per process
    assert got["mmapped_during"] == 0  # 24 MiB came from the heap, not a fresh mmap
    # after the first step, the steps' activations reuse heap pages already faulted in: nine
    # more steps fault less than the first one did (the heap still grows now and then with
    # fragmentation). glibc's default returns the memory, and later steps fault it back in
    # whenever its dynamic thresholds let it go (measured 5,000-15,000 faults a step here,
    # but not in every process: no test asserts that side)
    assert sum(got["faults"][1:]) < got["faults"][0], got["faults"]


_THREAD_PROBE = r"""
import json, random, resource, sys, threading
import torch
from xllm_vmm.engine import host_memory as hm
tuned = hm.configure_host_malloc() if sys.argv[1] == "engine" else None
faults = []
def steps():  # serve's engine thread: its own glibc arena, a chain of 64 MiB heaps
    rng = random.Random(0)
    for step in range(12):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for layer in range(4):  # activations whose sizes follow the step's token count
            n = rng.randrange(1, 30)
            a = torch.empty(n << 20, dtype=torch.uint8).fill_(1)
            b = torch.empty((2 * n) << 20, dtype=torch.uint8).fill_(1)
            del a
            c = torch.empty(n << 20, dtype=torch.uint8).fill_(1)
            del b, c
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
t = threading.Thread(target=steps)
t.start()
t.join()
print(json.dumps({"tuned": None if tuned is None else tuned.__dict__, "faults": faults}))
"""


def test_engine_thread_keeps_its_heaps():
    """glibc deletes a thread arena's wholly free 64 MiB heap whatever ``M_TRIM_THRESHOLD``
    says; ``M_TOP_PAD`` at a heap's size keeps it, so a thread's later steps stop faulting (the
    thresholds alone measured 10,000-57,000 faults in every one of these steps)."""
    e = {k: v for k, v in os.environ.items() if k != "XLLM_VMM_MALLOPT"}
    out = subprocess.run([sys.executable, "-c", _THREAD_PROBE, "engine"], capture_output=True,
                         text=True, env=e, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["tuned"]["applied"] is True and got["tuned"]["top_pad_bytes"] == 64 << 20
    first, later = got["faults"][0], got["faults"][6:]
    # one 4 KiB page per fault: the first step faults ~300 MiB in; the last six reuse it
    assert first > 20_000 and sum(later) * 50 < first, got["faults"]


def test_off_switch_keeps_glibc_default_path():
    got = _probe("engine", XLLM_VMM_MALLOPT="0")
    assert got["tuned"]["applied"] is False
    assert "XLLM_VMM_MALLOPT=0" in got["tuned"]["reason"]
    assert got["mmapped_during"] >= 24 << 20  # glibc's default: the block is mmapped


def test_worker_create_applies_it():
    """``Worker.create`` on a CPU pool tunes the process (the engine's start)."""
    script = r"""
import json, sys
from xllm_vmm.engine import host_memory as hm
from xllm_vmm import LLM
from xllm_vmm.engine.demo import demo_model_dir
assert hm.host_malloc_tuning() is None
llm = LLM(model=str(demo_model_dir()), device_memory="256MiB", max_model_len=64)
print(json.dumps(hm.host_malloc_tuning().__dict__))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, env={k: v for k, v in os.environ.items() if k != "XLLM_VMM_MALLOPT"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["applied"] is True
