"""Fixtures of the multi-worker tests: tiny checkpoints built once per session, and a check
that every worker process a test started is gone when it ends (no leftovers)."""

from __future__ import annotations

import os

import pytest

from tests.engine.checkpoints import llama_checkpoint, qwen3_checkpoint

BASE = {"device_memory": "64MiB", "block_size": 16}
"""Flags every multi-worker test starts from (small emulated devices, small blocks)."""


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    return llama_checkpoint(tmp_path_factory.mktemp("tp-llama"))


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    return qwen3_checkpoint(tmp_path_factory.mktemp("tp-qwen3"))


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def children() -> set[int]:
    """Pids of this process's live children."""
    me = os.getpid()
    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().split(") ", 1)[1].split()
            except (FileNotFoundError, IndexError, ProcessLookupError):
                continue
            if int(fields[1]) == me and fields[0] != "Z":
                out.add(int(d))
    return out


@pytest.fixture(autouse=True, scope="session")
def plain_host_pages():
    """Every worker (spawned workers inherit the environment) backs its pool with 4 KiB pages:
    several worker processes racing for the host's free huge pages (``hugepages=auto`` picks
    hugetlb when some are free, which another engineer's bench may have set) would fail a
    start-up with ENOSPC that has nothing to do with what these tests check."""
    import os

    old = os.environ.get("XLLM_VMM_HOST_HUGEPAGES")
    os.environ["XLLM_VMM_HOST_HUGEPAGES"] = "off"
    yield
    if old is None:
        os.environ.pop("XLLM_VMM_HOST_HUGEPAGES", None)
    else:
        os.environ["XLLM_VMM_HOST_HUGEPAGES"] = old


@pytest.fixture(autouse=True)
def no_leftover_workers():
    before = children()
    yield
    left = children() - before
    assert not left, f"worker processes left behind: {sorted(left)}"
