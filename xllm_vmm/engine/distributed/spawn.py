"""Starting the other workers of one command on this host, and tearing them down with it.

Rank 0 starts ranks ``1..W-1`` as ``python -m xllm_vmm.engine.distributed.follower SPEC``
(SPEC: JSON of the model directory, the same engine flags with ``node_rank`` and
``master_node_addr`` set, and the engine options). Each child gets ``PR_SET_PDEATHSIG``
(SIGKILL when rank 0 dies, Linux), so no worker outlives the command even when rank 0 is
killed; :func:`reap` ends them in order (wait, SIGTERM, SIGKILL) and never leaves a zombie.
A spawned worker runs one intra-op thread unless ``OMP_NUM_THREADS`` says otherwise (the
workers of one host share its cores; ``docs/benchmarks.md`` shows what oversubscription costs).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: reap() still ends the children
        pass


def package_root() -> str:
    """The directory holding the ``xllm_vmm`` package this process imported."""
    import xllm_vmm

    return os.path.dirname(os.path.dirname(os.path.abspath(xllm_vmm.__file__)))


def follower_env() -> dict[str, str]:
    """The environment of a follower: this one, with the package root this process imported
    ``xllm_vmm`` from first on ``PYTHONPATH``, so that every rank runs the same code (with its
    compiled libraries) wherever rank 0 was started."""
    env = dict(os.environ)
    root = package_root()
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != root]
    env["PYTHONPATH"] = os.pathsep.join([root, *rest])
    return env


def follower_python() -> list[str]:
    """The interpreter command of a follower. ``-P`` (Python 3.11+) keeps ``python -m`` from
    putting the working directory first on ``sys.path``: started from a source checkout, the
    follower imported that tree (no compiled ``.so``) instead of the package rank 0 runs."""
    return [sys.executable, "-P"] if sys.version_info >= (3, 11) else [sys.executable]


def spawn_followers(world: int, port: int, model_dir: str, flags: dict[str, Any],
                    opts: dict[str, Any], device_of_rank=None) -> list[subprocess.Popen]:
    """Start ranks 1..world-1 meeting rank 0 at ``127.0.0.1:port``; returns their processes
    (index ``r - 1`` is rank ``r``)."""
    env = follower_env()
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    env.setdefault("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    procs: list[subprocess.Popen] = []
    try:
        for r in range(1, world):
            f = dict(flags, node_rank=r, master_node_addr=f"127.0.0.1:{port}")
            if device_of_rank is not None:
                dev = device_of_rank(r)
                if dev is not None:
                    f["devices"] = dev
            spec = json.dumps({"model": model_dir, "flags": f, "opts": dict(opts, _spawned=True)})
            procs.append(subprocess.Popen(
                [*follower_python(), "-m", "xllm_vmm.engine.distributed.follower", spec],
                env=env, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent))
    except BaseException:
        reap(procs, 0)
        raise
    return procs


def reap(procs: list[subprocess.Popen], timeout: float, *,
         kill: bool = False) -> list[int | None]:
    """Wait up to ``timeout`` s for each process, then SIGTERM (``kill``: SIGKILL at once, for
    a lost worker set), then SIGKILL; returns the exit codes (every process is waited for: no
    zombies)."""
    codes: list[int | None] = []
    for p in procs:
        try:
            p.wait(timeout=max(timeout, 0.01))
        except subprocess.TimeoutExpired:
            p.kill() if kill else p.terminate()
            try:
                p.wait(timeout=3)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        codes.append(p.returncode)
    return codes
