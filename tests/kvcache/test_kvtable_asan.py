"""``native/kvtable.c`` under AddressSanitizer + UBSan: builds the library instrumented, then
runs ``tests/kvcache/test_kvtable.py`` (both paths in lockstep over every verb, refusals and
buffer growth included) in a subprocess that loads it (``XLLM_VMM_NATIVE_DIR``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BOTH_PATHS = False  # the subprocess runs both


def _runtime(name: str) -> str | None:
    r = subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True)
    path = r.stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


@pytest.mark.slow
def test_kvtable_is_clean_under_address_sanitizer(tmp_path):
    if shutil.which("gcc") is None:
        pytest.skip("gcc not installed")
    asan, ubsan = _runtime("libasan.so"), _runtime("libubsan.so")
    if asan is None or ubsan is None:
        pytest.skip("libasan / libubsan not installed")
    for lib in (ROOT / "xllm_vmm" / "vmm").glob("*.so"):  # the other libraries, as built
        shutil.copy(lib, tmp_path / lib.name)
    build = subprocess.run(
        ["gcc", "-std=gnu11", "-g", "-O1", "-fsanitize=address,undefined",
         "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer", "-Wall", "-Wextra",
         "-Werror", "-fPIC", "-shared", "-o", str(tmp_path / "libxllm_kvtable.so"),
         str(ROOT / "native" / "kvtable.c")], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    env = dict(os.environ, LD_PRELOAD=f"{asan} {ubsan}", XLLM_VMM_NATIVE_DIR=str(tmp_path),
               ASAN_OPTIONS="detect_leaks=0:abort_on_error=1", UBSAN_OPTIONS="halt_on_error=1")
    env.pop("XLLM_VMM_KVTABLE", None)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p",
                        "no:cacheprovider", "-n", "0", str(ROOT / "tests/kvcache/test_kvtable.py")],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "passed" in out and "skipped" not in out, out[-2000:]  # the library was loaded
