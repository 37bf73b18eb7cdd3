"""The process group of a worker set: rendezvous, backend, heartbeats.

Rendezvous: a ``torch.distributed`` TCP store served by rank 0 at ``master_node_addr``
(port 0: a free port, spawn only; the bound port is :attr:`Group.port`), then
``init_process_group`` over that store with the device's backend — gloo on CPU, NCCL on
CUDA, HCCL on NPU (``torch_npu``) — bounded by the start-up timeout, and a second group of the
same ranks, :attr:`Group.steps`, whose collectives (every step, every command) time out after
the serving timeout. Every wait is bounded: a
master that cannot be reached, or a rank that never arrives, is a
:class:`~xllm_vmm.engine.distributed.errors.DistributedError` naming the rank and the address.

Heartbeats: every rank > 0 bumps ``xv/hb/<rank>`` in the store every
:data:`HEARTBEAT_S` seconds over its own store connection; rank 0's :class:`Watchdog` reads
them and calls ``on_lost(rank, why)`` once for the first rank whose heartbeat stops for
``stale_s`` seconds (or whose spawned process exits). Commands from rank 0 travel through the
store too (``xv/cmd/<seq>``), so an idle follower waits on a socket, never on a collective
that could time out.
"""

from __future__ import annotations

import datetime as _dt
import threading
import time
from typing import TYPE_CHECKING, Callable

from xllm_vmm.engine.distributed.errors import DistributedError

if TYPE_CHECKING:  # pragma: no cover
    from xllm_vmm.engine.distributed.topology import Topology

HEARTBEAT_S = 0.25
"""Seconds between two heartbeats of a worker."""

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


def backend_for(device: str) -> str:
    """The ``torch.distributed`` backend for a torch device string (``cpu``, ``cuda:1``, ...)."""
    kind = str(device).split(":")[0]
    backend = BACKENDS.get(kind)
    if backend is None:
        raise DistributedError(f"no collective backend for device {device!r}",
                               hint=f"supported devices: {', '.join(BACKENDS)}")
    if backend == "hccl":
        try:
            import torch_npu  # noqa: F401  (registers the HCCL backend)
        except ImportError:
            raise DistributedError("HCCL needs torch_npu, which is not installed",
                                   hint="install torch_npu matching your CANN version") from None
    return backend


def _td(seconds: float) -> _dt.timedelta:
    return _dt.timedelta(seconds=seconds)


class Group:
    """This process's membership of the worker set (see the module docstring). ``store`` is
    the rendezvous store (rank 0: its server); ``port`` the bound rendezvous port."""

    def __init__(self, topo: Topology, device: str) -> None:
        import torch.distributed as dist

        self.topo = topo
        self.rank = topo.rank
        self.world = topo.world
        self.backend = backend_for(device)
        self.closed = False
        self.steps = None  # the process group of serving: collectives time out after timeout_s
        self._hb_thread: threading.Thread | None = None
        self._hb_stop = threading.Event()
        where = f"master_node_addr {topo.host}:{topo.port}"
        try:
            self.store = dist.TCPStore(topo.host, topo.port, None, topo.rank == 0,
                                       _td(topo.startup_timeout_s), wait_for_workers=False)
        except Exception as e:  # noqa: BLE001 - the store's errors are RuntimeErrors
            raise DistributedError(
                f"rank {topo.rank} could not {'serve' if topo.rank == 0 else 'reach'} the "
                f"rendezvous at {where} within {topo.startup_timeout_s:g} s: {_first_line(e)}",
                rank=topo.rank, address=topo.address,
                hint="start rank 0 first and check master_node_addr (rank 0's host and a free "
                     "port reachable from every node)") from None
        self.port = int(self.store.port)
        self.address = f"{topo.host}:{self.port}"
        if topo.rank > 0:
            self.store.set(f"xv/up/{topo.rank}", "1")  # reached the rendezvous

    def wait_spawned(self, procs: list) -> None:
        """Rank 0 of a spawn: wait until every spawned rank reached the rendezvous; one that
        exits first is a :class:`DistributedError` naming it and its exit code, at once (not
        after the start-up timeout)."""
        deadline = time.monotonic() + self.topo.startup_timeout_s
        while time.monotonic() < deadline:
            missing = [r for r in range(1, self.world) if not self.store.check([f"xv/up/{r}"])]
            if not missing:
                return
            for r in missing:
                code = procs[r - 1].poll()
                if code is not None:
                    raise DistributedError(
                        f"worker rank {r} (pid {procs[r - 1].pid}) exited with code {code} "
                        "before it joined; its own error is printed above", rank=r,
                        address=self.address)
            time.sleep(0.05)

    def join(self) -> None:
        """``init_process_group`` over the store; raises naming the ranks that did not come."""
        import torch.distributed as dist

        if dist.is_initialized():  # torch allows one default group per process
            raise DistributedError(
                f"rank {self.rank}: this process already has a live worker set (another LLM "
                "or engine with several workers was not shut down)", rank=self.rank,
                address=self.address,
                hint="call shutdown() on the other LLM (or drop it) before starting this one")
        try:
            dist.init_process_group(self.backend, store=self.store, rank=self.rank,
                                    world_size=self.world,
                                    timeout=_td(self.topo.startup_timeout_s))
            self.steps = dist.new_group(list(range(self.world)), backend=self.backend,
                                        timeout=_td(self.topo.timeout_s))
        except Exception as e:  # noqa: BLE001
            missing = self.missing_ranks() if self.rank == 0 else []
            who = (f"rank(s) {', '.join(map(str, missing))} never arrived" if missing
                   else "the worker set did not form")
            raise DistributedError(
                f"rank {self.rank}: {who} at {self.address} within "
                f"{self.topo.startup_timeout_s:g} s "
                f"({self.backend}): {_first_line(e)}", rank=missing[0] if missing else self.rank,
                address=self.address,
                hint=f"start all {self.world} processes (node_rank 0..{self.world - 1}) with the "
                     "same nnodes and master_node_addr") from None
        if self.rank > 0:
            self._start_heartbeat()

    def missing_ranks(self) -> list[int]:
        """Ranks > 0 that never reached the rendezvous (rank 0 only)."""
        out = []
        for r in range(1, self.world):
            try:
                here = self.store.check([f"xv/up/{r}"])
            except Exception:  # noqa: BLE001
                here = False
            if not here:
                out.append(r)
        return out

    # -- heartbeats (ranks > 0) ----------------------------------------------------------
    def _start_heartbeat(self) -> None:
        import torch.distributed as dist

        client = dist.TCPStore(self.topo.host, self.port, None, False,
                               _td(self.topo.startup_timeout_s))
        key = f"xv/hb/{self.rank}"

        def beat() -> None:
            n = 0
            while not self._hb_stop.wait(HEARTBEAT_S):
                n += 1
                try:
                    client.set(key, str(n))
                except Exception:  # noqa: BLE001 - rank 0 is gone: the command loop sees it
                    return

        client.set(key, "0")
        self._hb_thread = threading.Thread(target=beat, name=f"heartbeat[{self.rank}]",
                                           daemon=True)
        self._hb_thread.start()

    def close(self) -> None:
        """Leave the process group (idempotent)."""
        import torch.distributed as dist

        if self.closed:
            return
        self.closed = True
        self._hb_stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=2)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a lost peer: nothing left to tear down
                pass


class Watchdog:
    """Rank 0's view of the other ranks' liveness (module docstring). ``alive(rank)`` is an
    optional callable telling whether a spawned process still runs (None: not spawned here)."""

    def __init__(self, group: Group, stale_s: float, on_lost: Callable[[int, str], None],
                 alive: Callable[[int], str | None] | None = None) -> None:
        self.group = group
        self.stale_s = stale_s
        self.on_lost = on_lost
        self.alive = alive
        self.lost: tuple[int, str] | None = None
        self._stop = threading.Event()
        self._seen: dict[int, tuple[bytes, float]] = {}
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        self._thread.start()

    def check(self) -> tuple[int, str] | None:
        """One pass: the first lost rank and why, or None."""
        if self.lost is not None:
            return self.lost
        now = time.monotonic()
        for r in range(1, self.group.world):
            why = self.alive(r) if self.alive is not None else None
            if why is None:
                key = f"xv/hb/{r}"
                try:
                    store = self.group.store
                    value = store.get(key) if store.check([key]) else b""
                except Exception:  # noqa: BLE001
                    value = b""
                last = self._seen.get(r)
                if last is None or last[0] != value:
                    self._seen[r] = (value, now)
                elif now - last[1] > self.stale_s:
                    why = f"stopped answering (no heartbeat for {now - last[1]:.1f} s)"
            if why is not None:
                self.lost = (r, why)
                try:
                    self.on_lost(r, why)
                finally:
                    return self.lost
        return None

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if self.check() is not None:
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
