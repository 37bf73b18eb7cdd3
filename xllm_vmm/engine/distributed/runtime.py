"""``Runtime``: one process's part of a tensor-parallel worker set, and the rank-0 driver ↔
worker protocol.

Built by the engine's construction (``LLMEngine.from_flags`` → ``_build``) through
:func:`runtime_for`, which returns None at world size 1 (nothing here runs then). Every rank
builds the same engine from the same flags — the same plan, so the same per-worker cache
layout and slot geometry (checked at :meth:`Runtime.attach`) — with its own driver, pool,
weights shard (``load_weights(shard=...)``) and :class:`~xllm_vmm.engine.worker.Worker`
(``tp``: this rank). Rank 0 keeps the scheduler, the KV cache manager and the sampler; the
other ranks run :meth:`Runtime.serve`, a loop over rank 0's commands:

| command | rank 0 | every other rank | ends with |
|---|---|---|---|
| ``step`` (the step's chunks) | ``Worker.execute`` | ``StepInput.build`` + ``Worker.execute`` | status gather |
| ``activate`` / ``deactivate`` / ``move`` (slots) | its cache | its cache (:mod:`.fanout`) | status gather (+ rollback) |
| ``sleep`` / ``wake`` (level) | — | weights + KV of this rank | status gather (freed bytes) |
| ``fork`` (the parent instance) | its fork, built first | ``LLMEngine.fork`` of that instance | status gather (geometry, bytes) |
| ``close`` | — | shuts that fork's engine down | status gather |
| ``shutdown`` | — | leaves the loop, releases everything | status gather |

A command is written to the rendezvous store (``xv/cmd/<seq>``: an idle worker blocks on a
socket, not on a collective that times out) and every command ends with one
``all_gather_object`` of each rank's status — its budget left, mapped bytes, execution peak
and the command's result — so rank 0 learns every command's outcome on every rank in one
collective. Logits come back from rank 0 only (the vocabulary-parallel head gathers its
slices there). After every status gather rank 0's pool gets the smallest budget left among the
other workers (``VmmPool.peer_budget_left_bytes``): admission uses the minimum capacity across
workers (AD-02), refreshed every step.

Fork across workers (one channel, multiplexed). A fork is a second engine instance over the
same processes: every rank forks its own weight shard (the pages shared: +0 weight bytes per
worker) and builds the fork's own pool, KV cache manager and worker on its driver. Its
commands travel over the *same* store keys and process group as the parent's, each tagged
with its instance id (``(instance, op, payload)``; the parent is instance 0, forks get
1, 2, ... from rank 0), and a worker's one command loop dispatches each to that instance's
engine. Rank 0 holds one command lock across a whole command — the store write, its own part
(a step's all-reduces) and the status gather — so the collectives of two instances never
interleave on the group, whichever threads step them. Chosen over a second channel (a second
``new_group``, store namespace and follower thread per fork) because it is the simpler sound
design: the ranks' collectives stay one totally ordered sequence, a lost worker is one
failure for every instance (the watchdog and the abort event are shared), and a fork costs
no new group or thread. What it gives up: the parent's and the fork's steps do not overlap
in time across the workers (on CPU they would compete for the same cores anyway).

A fork is built on rank 0 first (``LLMEngine.fork`` → :meth:`Runtime.fork_view` → the
build → :meth:`Runtime.attach`), then ``fork`` makes every other rank build its own (a
barrier); each rank reports what it added (``fork_workers``: ``weight_bytes_added`` — device
bytes beyond the fork's own pool —, ``device_bytes_added``, ``pool_held_bytes``). A fork
that fails on one rank, or builds another cache geometry there, is closed on every rank and
the error names the rank; a worker lost during the fork is the worker set's
:class:`~xllm_vmm.engine.distributed.errors.WorkerLost`. Closing the fork (its
``shutdown``) sends ``close``: every rank releases the fork's pool, cache and weight
instance. What a fork refuses across workers: :func:`xllm_vmm.config.parallel.fork_refusals`.

Faults: any failed collective or store operation on rank 0, or the watchdog (a spawned
process that exited, a heartbeat that stopped), makes the runtime *lost*: a
:class:`~xllm_vmm.engine.distributed.errors.WorkerLost` naming the rank, raised by this and
every later call and delivered to the failure listeners (the server turns it into /health
503 and a clean stop). Rank 0's death ends every other rank (its store connection closes;
spawned ranks also get SIGKILL from the kernel).
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from xllm_vmm.engine.distributed.errors import DistributedError, WorkerLost
from xllm_vmm.engine.distributed.topology import DIST_OPTIONS, Topology, topology_of

if TYPE_CHECKING:  # pragma: no cover
    from xllm_vmm.engine.step import StepInput, StepOutput

_ROW = ("rank", "pid", "budget_left_bytes", "mapped_bytes", "kv_mapped_bytes",
        "execution_peak_bytes", "held_bytes", "device_used_bytes")
"""The numbers of a status, in the order of its int64 row (then ``ok``: -1/0/1, error: 0/1)."""
_OK = {None: -1, False: 0, True: 1}
_OBJECT_OPS = ("sleep", "wake", "fork")
"""Commands whose statuses carry reports (pickled)."""

_COMM_WORDS = ("gloo", "nccl", "hccl", "connection", "closed", "timed out", "timeout",
               "peer", "socket", "broken pipe", "reset")


def runtime_for(cfg: Any, opts: dict[str, Any], *, model_dir: str, kind: str,
                index: int, fork: bool = False) -> Runtime | None:
    """Join (rank > 0) or form (rank 0, spawning the others when started alone) the worker
    set ``cfg`` describes; None at world size 1. ``fork``: an engine forked from another
    without its parent's runtime — refused across several workers (a fork's runtime is its
    parent's :meth:`Runtime.fork_view`, which ``LLMEngine.fork`` passes to the build)."""
    topo = topology_of(cfg, opts)
    if topo is None:
        return None
    if fork:
        raise DistributedError(
            "an engine forked across several workers is built over its parent's worker set "
            "(Runtime.fork_view), not a new one", hint="fork with LLMEngine.fork()")
    return Runtime.start(topo, cfg, opts, model_dir=model_dir, kind=kind, index=index)


def device_used_bytes(driver: Any) -> int:
    """Device bytes in use on ``driver`` now: its committed handle bytes (every pool on it),
    else total − free."""
    st = getattr(driver, "stats", None)
    if st is not None:
        try:
            v = st().get("committed_bytes")
        except Exception:  # noqa: BLE001 - a driver without the counter
            v = None
        if v is not None:
            return int(v)
    mi = driver.mem_info()
    return int(mi.total - mi.free)


def _torch_device(kind: str, index: int) -> str:
    return "cpu" if kind == "host" else f"{'npu' if kind == 'acl' else kind}:{index}"


def _json_opts(opts: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in opts.items():
        if k == "progress":  # this process's display only
            continue
        if type(v).__module__ == "torch":  # a torch.dtype
            v = str(v).replace("torch.", "")
        out[k] = list(v) if isinstance(v, tuple) else v
    return out


class _Link:
    """What every engine instance over one worker set shares — the parent (instance 0) and
    its forks: the command sequence and the lock held across a whole command (rank 0), the
    failure and its listeners, the watchdog, and (ranks > 0) the instances the command loop
    dispatches to."""

    def __init__(self) -> None:
        self.seq = 0
        self.command = threading.Lock()
        self.owner: int | None = None  # the thread inside a command (rank 0)
        self.next_iid = 1  # rank 0: the next fork's instance id
        self.pending_iid: int | None = None  # ranks > 0: the id of the fork being built
        self.instances: dict[int, tuple[Any, Any]] = {}  # ranks > 0: id -> (runtime, engine)
        self.failure: WorkerLost | None = None
        self.listeners: list[Callable[[WorkerLost], None]] = []
        self.lock = threading.Lock()
        self.watchdog: Any = None
        self.closed = False


class Runtime:
    """See the module docstring. ``tp`` is this rank's
    :class:`~xllm_vmm.engine.layers.parallel.TensorParallel` (with the shard hook). ``iid``:
    the engine instance this runtime carries commands for (0: the parent; a fork's runtime
    is :meth:`fork_view`); ``parent_iid``: the instance a fork was forked from."""

    def __init__(self, topo: Topology, group: Any, procs: list, tp: Any,
                 abort: threading.Event | None = None, *, link: _Link | None = None,
                 iid: int = 0, parent_iid: int | None = None) -> None:
        self.topo = topo
        self.group = group
        self.procs = procs
        self.rank = topo.rank
        self.world = topo.world
        self.tp = tp
        self._link = link if link is not None else _Link()
        self.iid = iid
        self.parent_iid = parent_iid
        self.cfg: Any = None
        self._active = False
        self.closed = False
        self.statuses: list[dict[str, Any]] = []
        self.commands = 0
        self.collective_seconds = 0.0
        self.steps = 0
        self.step_seconds = 0.0
        self.step_comm: dict[str, float] = {}
        self.lost_event = abort if abort is not None else threading.Event()
        """Set when a worker is lost: rank 0's collectives stop waiting (:mod:`.deadline`)."""
        self.cache = self.pool = self.worker = None
        self.host_driver = self.regions = None  # the host KV tier's copies (.fanout)
        self.geometry: dict[str, Any] | None = None
        self.fork_workers: list[dict[str, Any]] = []
        """A fork's runtime on rank 0: what the fork added on each rank (index = rank)."""
        self.fork_report: dict[str, Any] = {}
        self._fork_before: tuple[int, int] = (0, 0)
        self._parent_pool: Any = None

    # shared by every instance over the worker set (_Link)
    @property
    def failure(self) -> WorkerLost | None:
        return self._link.failure

    @failure.setter
    def failure(self, value: WorkerLost | None) -> None:
        self._link.failure = value

    @property
    def watchdog(self) -> Any:
        return self._link.watchdog

    @watchdog.setter
    def watchdog(self, value: Any) -> None:
        self._link.watchdog = value

    @property
    def _lock(self) -> threading.Lock:
        return self._link.lock

    @property
    def _listeners(self) -> list[Callable[[WorkerLost], None]]:
        return self._link.listeners

    @property
    def active(self) -> bool:
        """Commands go to every rank (False before attach, once closed, and for every
        instance once a worker is lost: what is left to release is released locally)."""
        return self._active and self._link.failure is None and not self._link.closed

    @active.setter
    def active(self, value: bool) -> None:
        self._active = bool(value)

    # -- start-up ------------------------------------------------------------------------
    @classmethod
    def start(cls, topo: Topology, cfg: Any, opts: dict[str, Any], *, model_dir: str,
              kind: str, index: int) -> Runtime:
        from xllm_vmm.config import ConfigError, Finding
        from xllm_vmm.engine.distributed.group import Group, Watchdog
        from xllm_vmm.engine.distributed.sharding import check_divisible, shard_hook
        from xllm_vmm.engine.distributed.spawn import reap, spawn_followers
        from xllm_vmm.engine.layers.parallel import TensorParallel
        from xllm_vmm.engine.models.config import ModelConfig
        from xllm_vmm.models.errors import LayoutError

        from xllm_vmm.engine.models import model_class

        mcfg = ModelConfig.from_dir(model_dir)
        if not getattr(model_class(mcfg.architecture), "tp_prefix_cache", True) and bool(
                cfg["enable_prefix_cache"]):
            raise ConfigError([Finding(
                "CFG-CONFLICT", "error", f"enable_prefix_cache=true with {topo.world} workers: "
                f"{mcfg.architecture}'s prefix hits restore a linear-state checkpoint, which is "
                "a per-worker shard that only rank 0 keeps", flags={
                    "enable_prefix_cache": True, "nnodes": cfg["nnodes"]},
                hint="set --enable_prefix_cache=false, or serve on one device")])
        try:
            if topo.world > 1 and not model_class(mcfg.architecture).tensor_parallel:
                raise LayoutError(f"{mcfg.architecture} runs on one worker only in this engine "
                                  "(no tensor-parallel split of this family yet)",
                                  hint="use nnodes=1")
            check_divisible(mcfg, topo.world, topo.ep)
        except LayoutError as e:
            raise ConfigError([Finding("CFG-CONFLICT", "error", str(e), flags={
                "nnodes": cfg["nnodes"], **({"ep_size": topo.ep} if topo.ep > 1 else {})},
                hint=getattr(e, "hint", ""))]) from None
        group = Group(topo, _torch_device(kind, index))
        procs: list = []
        try:
            if topo.spawn:
                from xllm_vmm.engine.distributed.topology import device_list, spawns_per_device

                flags = {n: cfg[n] for n in cfg.explicit_names() if n != "model"}
                flags["nnodes"] = topo.world
                listed = device_list(cfg) if spawns_per_device(cfg) else []

                def device_of_rank(r: int) -> str | None:
                    if listed:
                        return listed[r]
                    return None if kind == "host" else _torch_device(kind, index + r)

                procs = spawn_followers(topo.world, group.port, model_dir, flags,
                                        _json_opts({k: v for k, v in opts.items()}),
                                        device_of_rank)
                group.wait_spawned(procs)
            group.join()
        except BaseException:
            reap(procs, 0)
            group.close()
            raise
        abort = threading.Event()
        tp = TensorParallel(topo.rank, topo.world, group=group.steps,
                            shard_hook=shard_hook(mcfg, topo.rank, topo.world, topo.ep),
                            ep_size=topo.ep,
                            vocab_size=int(mcfg.vocab_size),
                            abort=abort if topo.rank == 0 else None)
        rt = cls(topo, group, procs, tp, abort)
        rt.cfg = cfg
        if topo.rank == 0:
            rt.watchdog = Watchdog(group, topo.heartbeat_timeout_s, rt._on_lost,
                                   alive=rt._proc_exit if procs else None)
        return rt

    def device_memory(self, default: int | None) -> int | None:
        """The emulated device size of this rank (``worker_device_memory``) or ``default``."""
        mem = self.topo.worker_device_memory
        return mem[self.rank] if mem else default

    def attach(self, mgr: Any, worker: Any, pool: Any) -> Any:
        """Check that every rank built the same cache geometry, route rank 0's slot
        activations to every worker, and return what the engine uses as its worker (rank 0:
        a :class:`DriverWorker`; other ranks: ``worker`` itself)."""
        from xllm_vmm.engine.distributed.fanout import CopyRegions

        self.cache, self.pool, self.worker = mgr.cache, pool, worker
        host = getattr(mgr, "host", None)  # the host KV tier (host_blocks_factor > 0)
        self.host_driver = host.driver if host is not None else None
        self.regions = CopyRegions(mgr.cache, host.pool) if host is not None else None
        geo = {"slots": {g: v.num_slots for g, v in mgr.cache.geometry.items()},
               "block_size": int(mgr.block_size), "page_bytes": int(pool.page_bytes),
               "host_blocks": int(host.pool.capacity) if host is not None else 0}
        self.geometry = geo
        if self.iid != 0:  # a fork: every rank builds it when rank 0 says so (fork_view)
            return self._attach_fork(mgr, worker, host)
        try:
            hellos = self._gather(self._status({"geometry": geo, "device": str(worker.device)}),
                                  startup=True)
        except Exception as e:  # noqa: BLE001
            if not self._looks_like_comm(e):
                raise
            addr = self.group.address
            if self.rank != 0:
                raise DistributedError(f"rank 0 at {addr} went away during start-up (its error "
                                       "is on its own output)", rank=0, address=addr) from None
            self._lost_from(e)
            rank, why = self.watchdog.lost if self.watchdog and self.watchdog.lost else (-1, "")
            raise DistributedError(f"worker rank {rank} {why or 'failed'} during start-up; its "
                                   f"own error is printed above (rendezvous {addr})", rank=rank,
                                   address=addr) from None
        for s in hellos[1:]:
            if s["geometry"] != hellos[0]["geometry"]:
                raise DistributedError(
                    f"worker rank {s['rank']} built a KV cache of {s['geometry']}, rank 0 "
                    f"{hellos[0]['geometry']}: every worker must run with the same flags",
                    rank=s["rank"], address=self.group.address,
                    hint="start every process with the same model, flags and device_memory")
        self._refresh(hellos)
        self.active = True
        return self._route(mgr, worker, host)

    def _route(self, mgr: Any, worker: Any, host: Any) -> Any:
        from xllm_vmm.engine.distributed.fanout import FanoutBacking

        if self.rank == 0:
            fan = FanoutBacking(mgr.cache, self, copy_driver=self.host_driver,
                                regions=self.regions)
            mgr.cache.allocator.backing = fan
            if host is not None:  # host-tier copies on every worker, all or nothing
                host.driver = fan
            return DriverWorker(worker, self)
        return worker

    # -- fork (module docstring) ---------------------------------------------------------
    def fork_view(self) -> Runtime:
        """The runtime of a fork of this instance, before its build (``LLMEngine.fork`` passes
        it to the build, which ends with :meth:`attach`): same processes, group and channel, a
        new instance id (rank 0 gives it; a worker takes the one of rank 0's ``fork``
        command). Records this rank's device bytes in use, to report what the fork added.
        Raises :func:`~xllm_vmm.config.parallel.fork_refusals`'s refusal as a
        :class:`~xllm_vmm.config.ConfigError`, and the worker set's failure when lost."""
        from xllm_vmm.config import ConfigError, Finding
        from xllm_vmm.config.parallel import fork_refusals

        self.raise_if_lost()
        refused = fork_refusals(self.cfg) if self.cfg is not None else []
        if refused:
            raise ConfigError([Finding("CFG-CONFLICT", "error", message,
                                       flags={flag: self.cfg[flag]}, hint=hint)
                               for flag, message, hint in refused])
        link = self._link
        if self.rank == 0:
            iid = link.next_iid
            link.next_iid += 1
        elif link.pending_iid is not None:
            iid = link.pending_iid
        else:
            raise DistributedError(f"worker rank {self.rank} forks its engine when rank 0's "
                                   "fork command says so, not on its own", rank=self.rank,
                                   address=self.group.address, hint="fork on rank 0")
        view = Runtime(self.topo, self.group, self.procs, self.tp, self.lost_event, link=link,
                       iid=iid, parent_iid=self.iid)
        view.cfg = self.cfg
        pool = self.pool
        view._fork_before = (device_used_bytes(pool.driver), int(pool.held_bytes))
        view._parent_pool = pool
        return view

    def _attach_fork(self, mgr: Any, worker: Any, host: Any) -> Any:
        """:meth:`attach` of a fork: this rank's report; rank 0 then has every other rank
        build its fork (``fork``), checks their geometry and closes the fork everywhere when
        one rank failed (the error names it)."""
        used0, held0 = self._fork_before
        used = device_used_bytes(self.pool.driver)
        own = int(self.pool.held_bytes)
        parent_grew = int(self._parent_pool.held_bytes) - held0
        self.fork_report = {"device_bytes_added": used - used0, "pool_held_bytes": own,
                            "weight_bytes_added": used - used0 - own,
                            "parent_pool_bytes_added": parent_grew}
        if self.rank != 0:
            self.active = True
            return self._route(mgr, worker, host)
        geo, report = self.geometry, self.fork_report
        statuses = self.call("fork", self.parent_iid,
                             lambda: {"ok": True, "geometry": geo, "report": report})
        bad = None
        for st in statuses[1:]:
            if st.get("error") or not st.get("ok"):
                bad = (st["rank"], st.get("error") or "failed")
            elif st.get("geometry") != geo:
                bad = (st["rank"], f"it built a KV cache of {st.get('geometry')}, rank 0 {geo}")
            if bad is not None:
                break
        if bad is not None:
            try:  # the ranks that built it release it again
                self.call("close", None, lambda: {})
            except DistributedError:
                pass
            self.closed = True
            raise DistributedError(f"fork failed on worker rank {bad[0]}: {bad[1]}; the fork is "
                                   "closed on every worker", rank=bad[0],
                                   address=self.group.address,
                                   hint="give every worker room for the fork's KV cache "
                                        "(worker_device_memory), or fork with fewer blocks")
        self.fork_workers = [{"rank": st["rank"], **st.get("report", {})} for st in statuses]
        self.active = True
        return self._route(mgr, worker, host)

    # -- protocol (rank 0) ---------------------------------------------------------------
    def call(self, op: str, payload: Any, local: Callable[[], dict | None]) -> list[dict]:
        """Send ``op`` (for this instance) to every other rank, run ``local()`` here, gather
        every rank's status (index = rank). One command at a time over the worker set: the
        link's command lock is held across all of it (module docstring), whichever instance
        and thread calls; a command issued from inside another (``local`` calling back) is a
        :class:`DistributedError`, not a deadlock. Raises :class:`WorkerLost` when a worker
        is gone."""
        link = self._link
        me = threading.get_ident()
        if link.owner == me:
            raise DistributedError(f"{op!r} issued inside another command of the worker set "
                                   "(the ranks would disagree on the command sequence)",
                                   address=self.group.address)
        with link.command:
            link.owner = me
            try:
                return self._call(op, payload, local)
            finally:
                link.owner = None

    def _call(self, op: str, payload: Any, local: Callable[[], dict | None]) -> list[dict]:
        self.raise_if_lost()
        self._link.seq += 1
        key = f"xv/cmd/{self._link.seq}"
        try:
            self.group.store.set(key, pickle.dumps((self.iid, op, payload), protocol=5))
            try:
                result = local() or {}
            except Exception as e:  # noqa: BLE001
                if self._looks_like_comm(e):
                    raise
                # rank 0's own part failed (before any collective, as a validation does): the
                # others still end the command with the status gather; keep it in step
                self._gather(self._status({"error": f"{type(e).__name__}: {e}"}),
                             objects=op in _OBJECT_OPS)
                raise
            statuses = self._gather(self._status(result), objects=op in _OBJECT_OPS)
        except WorkerLost:
            raise
        except Exception as e:  # noqa: BLE001
            if not self._looks_like_comm(e):
                raise
            raise self._lost_from(e) from None
        self.commands += 1
        try:
            self.group.store.delete_key(key)
        except Exception:  # noqa: BLE001 - a key left behind costs bytes, not correctness
            pass
        self._refresh(statuses)
        if op not in ("activate", "sleep", "copy", "fork"):  # those roll back / fail softly
            self.check_errors(op, statuses)
        return statuses

    def check_errors(self, op: str, statuses: list[dict]) -> None:
        """A :class:`DistributedError` naming the first rank whose ``op`` raised."""
        for s in statuses[1:]:
            if s.get("error"):
                raise DistributedError(f"worker rank {s['rank']}: {op} failed: {s['error']}",
                                       rank=s["rank"], address=self.group.address)

    def sleep_all(self, level: int, local: dict, before: list[dict],
                  undo: Callable[[], Any]) -> dict:
        """After rank 0 slept (``local``: its report; ``before``: every rank's status before):
        every other rank sleeps its weights and KV at ``level``; returns ``local`` with
        ``workers`` — per rank ``bytes_freed`` / ``kv_bytes_freed`` (device bytes unmapped
        since ``before``) and that rank's own report. When one rank fails, every rank is woken
        again (``undo`` wakes rank 0) and the error names the rank. Other ranks: ``local``."""
        if self.rank != 0:  # a worker sleeps when rank 0 tells it to
            return local
        statuses = self.call("sleep", level, lambda: {"report": local})
        bad = next((s for s in statuses[1:] if s.get("error")), None)
        if bad is not None:
            undo()
            self.call("wake", None, lambda: {})
            raise DistributedError(f"sleep failed on worker rank {bad['rank']}: {bad['error']}; "
                                   "every worker is awake again", rank=bad["rank"],
                                   address=self.group.address)
        return dict(local, workers=self._freed(before, statuses))

    def wake_all(self, local: dict) -> dict:
        """After rank 0 woke: every other rank wakes (a barrier); ``workers``: each rank's
        report. Other ranks: ``local``."""
        if self.rank != 0:
            return local
        statuses = self.call("wake", None, lambda: {"report": local})
        return dict(local, workers=[{"rank": s["rank"], **s.get("report", {})} for s in statuses])

    @staticmethod
    def _freed(before: list[dict], after: list[dict]) -> list[dict]:
        return [{"rank": a["rank"],
                 "bytes_freed": max(0, b["mapped_bytes"] - a["mapped_bytes"]),
                 "kv_bytes_freed": max(0, b["kv_mapped_bytes"] - a["kv_mapped_bytes"]),
                 "report": a.get("report", {})} for b, a in zip(before, after)]

    def raise_if_lost(self) -> None:
        if self.failure is not None:
            raise self.failure
        if self.closed or self._link.closed:
            raise DistributedError("the worker set is shut down" if self._link.closed else
                                   f"engine instance {self.iid} (a fork) is closed",
                                   address=self.group.address)

    def add_failure_listener(self, fn: Callable[[WorkerLost], None]) -> None:
        """``fn(error)`` is called once (from the watchdog or the engine thread) when a worker
        is lost; at once if it already is."""
        with self._lock:
            self._listeners.append(fn)
            failed = self.failure
        if failed is not None:
            fn(failed)

    def refresh(self) -> list[dict[str, Any]]:
        """Ask every rank for its status now (rank 0; also refreshes the admission cap). Other
        ranks: their last statuses."""
        if self.rank != 0:
            return self.worker_stats()
        self.call("status", None, lambda: {})
        return self.worker_stats()

    def record_step(self, seconds: float, before: dict, after: dict) -> None:
        """Rank 0: one step took ``seconds``; ``before``/``after``: collective counters."""
        self.steps += 1
        self.step_seconds += seconds
        for k, v in after.items():
            self.step_comm[k] = self.step_comm.get(k, 0) + v - before.get(k, 0)

    def stats(self) -> dict[str, Any]:
        """What a benchmark and ``/metrics`` report of the worker set (rank 0): world size,
        steps, mean step time and mean all-reduce time per step (seconds, measured on rank 0:
        it includes waiting for the slowest rank), all-reduces and their bytes per step, the
        per-command status gather time, and each worker's last status (``workers``: mapped
        and KV-mapped bytes, budget left); ``instance`` (0: the parent, else a fork, with
        ``fork_workers``: what the fork added on each rank)."""
        n = max(1, self.steps)
        c = self.step_comm
        return {
            "world_size": self.world,
            "steps": self.steps,
            "step_seconds_mean": self.step_seconds / n,
            "all_reduce_seconds_per_step": c.get("all_reduce_seconds", 0.0) / n,
            "all_reduce_calls_per_step": c.get("all_reduce_calls", 0) / n,
            "all_reduce_bytes_per_step": c.get("all_reduce_bytes", 0) / n,
            "logits_gather_seconds_per_step": c.get("logits_gather_seconds", 0.0) / n,
            "status_gather_seconds_per_command": self.collective_seconds / max(1, self.commands),
            "workers": self.worker_stats(),
            "instance": self.iid,
            **({"fork_workers": [dict(w) for w in self.fork_workers]} if self.iid else {}),
        }

    def worker_stats(self) -> list[dict[str, Any]]:
        """Each rank's last status (rank, pid, budget_left_bytes, mapped_bytes,
        kv_mapped_bytes, execution_peak_bytes), index = rank."""
        return [dict(s) for s in self.statuses]

    def _status(self, result: dict) -> dict[str, Any]:
        pool = self.pool
        st: dict[str, Any] = {"rank": self.rank, "pid": os.getpid()}
        if pool is not None:
            ps = pool.stats()
            st.update(budget_left_bytes=int(pool.budget_left_bytes()),
                      mapped_bytes=int(ps.mapped_bytes),
                      kv_mapped_bytes=int(ps.per_tenant_mapped_bytes.get("kv", 0)),
                      execution_peak_bytes=int(ps.execution_peak_bytes),
                      held_bytes=int(ps.held_bytes),
                      device_used_bytes=device_used_bytes(pool.driver))
        st.update(result)
        return st

    def _gather(self, status: dict, startup: bool = False, objects: bool = False) -> list[dict]:
        """Every rank's status (index = rank); ``startup``: over the start-up group (its
        timeout waits for the slowest rank's weights), else the serving group. The numbers
        of a status travel as one int64 row per rank (one collective); ``objects`` (reports,
        the start-up geometry) pickles whole statuses, and so does a failed command's error
        text, in a second gather that every rank joins when any row says so."""
        import torch
        import torch.distributed as dist

        from xllm_vmm.engine.distributed import deadline

        group = None if startup else self.group.steps
        abort = self.lost_event if self.rank == 0 and not startup else None
        t0 = time.perf_counter()
        try:
            if startup:
                out: list[Any] = [None] * self.world
                dist.all_gather_object(out, status, group=group)
                return out
            if objects:
                return deadline.all_gather_object(status, self.world, group, abort)
            row = torch.tensor([int(status.get(k, 0)) for k in _ROW]
                               + [_OK.get(status.get("ok"), -1), int(bool(status.get("error")))],
                               dtype=torch.int64)
            rows = [torch.empty_like(row) for _ in range(self.world)]
            deadline.all_gather(rows, row, group, abort)
            out = []
            for r in rows:
                v = r.tolist()
                st: dict[str, Any] = dict(zip(_ROW, v))
                if v[len(_ROW)] >= 0:
                    st["ok"] = bool(v[len(_ROW)])
                out.append(st)
            if any(r[-1].item() for r in rows):
                errors = deadline.all_gather_object(status.get("error"), self.world, group,
                                                    abort)
                for st, e in zip(out, errors):
                    if e:
                        st["error"] = e
            return out
        finally:
            self.collective_seconds += time.perf_counter() - t0

    def _refresh(self, statuses: list[dict]) -> None:
        self.statuses = statuses
        if self.rank == 0 and self.pool is not None:
            budgets = [s["budget_left_bytes"] for s in statuses[1:] if "budget_left_bytes" in s]
            if budgets:
                self.pool.peer_budget_left_bytes = min(budgets)

    # -- faults --------------------------------------------------------------------------
    def _proc_exit(self, rank: int) -> str | None:
        p = self.procs[rank - 1]
        code = p.poll()
        if code is None:
            return None
        return f"(pid {p.pid}) exited with {'signal ' + str(-code) if code < 0 else 'code ' + str(code)}"

    def _on_lost(self, rank: int, why: str) -> None:
        err = WorkerLost(f"worker rank {rank} {why}: the worker set cannot compute any more "
                         f"(rendezvous {self.group.address})", rank=rank,
                         address=self.group.address,
                         hint="the server stops; restart every process of the service")
        with self._lock:
            if self.failure is not None:
                return
            self.failure = err
            self.lost_event.set()  # rank 0's collectives waiting on the lost rank end now
            self.active = False  # what is left to release is released here only
            listeners = list(self._listeners)
        for fn in listeners:
            try:
                fn(err)
            except Exception:  # noqa: BLE001 - a listener must not hide the failure
                pass

    def _looks_like_comm(self, e: BaseException) -> bool:
        import torch.distributed as dist

        from xllm_vmm.engine.distributed.deadline import CollectiveAborted

        if isinstance(e, (dist.DistError, CollectiveAborted)):
            return True
        return isinstance(e, RuntimeError) and any(w in str(e).lower() for w in _COMM_WORDS)

    def _lost_from(self, e: BaseException) -> WorkerLost:
        """The failure after a failed collective: the watchdog names the rank (waiting up to
        its staleness window for a heartbeat to stop)."""
        wd = self.watchdog
        if wd is not None:
            deadline = time.monotonic() + wd.stale_s + 2 * 0.25 + 1.0
            while wd.check() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        if self.failure is None:
            self._on_lost(-1, f"(rank unknown) failed a collective: "
                          f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}")
        return self.failure  # type: ignore[return-value]

    # -- worker loop (ranks > 0) ---------------------------------------------------------
    def serve(self, engine: Any = None) -> int:
        """Run rank 0's commands (``engine``: this rank's engine, for sleep, wake and fork;
        a command tagged with a fork's instance id goes to that fork's engine) until
        ``shutdown`` (returns 0) or until rank 0 is gone (returns 3, after a message on
        stderr)."""
        import torch.distributed as dist

        store = self.group.store
        instances = self._link.instances
        instances[self.iid] = (self, engine)
        seq = 0
        while True:
            seq += 1
            key = f"xv/cmd/{seq}"
            try:
                while True:
                    try:
                        data = store.get(key)  # waits for the key (the store's timeout)
                        break
                    except dist.DistStoreError:  # idle: no command for a while
                        continue
                iid, op, payload = pickle.loads(data)
            except dist.DistError as e:
                print(f"xllm-vmm worker rank {self.rank}: rank 0 at {self.group.address} is "
                      f"gone ({str(e).strip().splitlines()[0]}); stopping", file=sys.stderr)
                return 3
            if op == "shutdown":
                self._gather(self._status({}))
                return 0
            rt, eng = instances.get(iid, (None, None))
            try:
                if op == "fork":  # build instance ``iid`` as a fork of instance ``payload``
                    result, rt = self._fork_here(iid, payload)
                elif op == "close":
                    result = self._close_here(iid)
                    rt = None
                elif rt is None:
                    raise DistributedError(f"worker rank {self.rank} has no engine instance "
                                           f"{iid} (command {op!r})")
                else:
                    result = rt._handle(op, payload, eng)
            except Exception as e:  # noqa: BLE001 - reported to rank 0, which raises it
                result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            rt = rt if rt is not None else self  # a status of some instance on this rank
            statuses = rt._gather(rt._status(result), objects=op in _OBJECT_OPS)
            if op == "activate" and result["ok"] and not all(s["ok"] for s in statuses):
                rt.cache.deactivate(payload)  # rolled back on every worker

    def _fork_here(self, iid: int, parent: int) -> tuple[dict, Runtime | None]:
        """A worker's part of ``fork``: fork instance ``parent``'s engine as instance
        ``iid`` (``LLMEngine.fork``, whose runtime is :meth:`fork_view`)."""
        entry = self._link.instances.get(parent)
        if entry is None:
            return {"ok": False, "error": f"worker rank {self.rank} has no engine instance "
                                          f"{parent} to fork"}, None
        self._link.pending_iid = iid
        try:
            child = entry[1].fork()
        finally:
            self._link.pending_iid = None
        rt = child.distributed
        self._link.instances[iid] = (rt, child)
        return {"ok": True, "geometry": rt.geometry, "report": rt.fork_report}, rt

    def _close_here(self, iid: int) -> dict:
        """A worker's part of ``close``: shut fork ``iid``'s engine down (its pool, cache and
        weight instance); nothing when this rank does not hold it (a fork that failed here)."""
        if iid == self.iid:
            raise DistributedError("the parent instance closes with shutdown, not close")
        entry = self._link.instances.pop(iid, None)
        if entry is not None:
            entry[0].closed = True
            entry[1].shutdown()
        return {}

    def _handle(self, op: str, payload: Any, engine: Any = None) -> dict:
        if op == "step":
            from xllm_vmm.engine.step import StepInput

            chunks, block_size = payload
            out = self.worker.execute(StepInput.build(chunks, block_size))
            self.pool.observe_execution_peak(int(out.execution_peak_bytes or 0))
            return {}
        if op == "activate":
            return {"ok": bool(self.cache.activate(payload))}
        if op == "deactivate":
            self.cache.deactivate(payload)
            return {}
        if op == "move":
            return {"ok": bool(self.cache.move(payload))}
        if op == "status":
            return {}
        if op == "copy":  # a host-tier offload or restore (.fanout)
            from xllm_vmm.engine.distributed.fanout import run_copy

            if self.regions is None:
                raise DistributedError(f"worker rank {self.rank} has no host KV tier")
            return run_copy(self.host_driver, self.regions, payload)
        if op == "sleep":
            return {"report": engine.sleep(int(payload))}
        if op == "wake":
            return {"report": engine.wake_up()}
        raise DistributedError(f"worker rank {self.rank} got an unknown command {op!r}")

    # -- shutdown ------------------------------------------------------------------------
    def abort(self) -> None:
        """Start-up failed on this rank: leave at once (other ranks see it as a lost worker
        or a missing rank and stop too). A fork's build that failed: the fork is closed on
        every rank that built it (:meth:`close`); the worker set stays."""
        if self.iid != 0:
            self.close()
            return
        if self.failure is None and self.rank == 0:
            self._on_lost(0, "(rank 0) failed to start")
        self.active = False
        self.close()

    def close(self) -> None:
        """Rank 0: every other rank leaves its loop and releases everything; spawned
        processes are reaped (SIGTERM/SIGKILL after a grace period when lost). Then this rank
        leaves the group. A fork's runtime: every other rank shuts that fork down (``close``),
        the worker set stays. Idempotent."""
        from xllm_vmm.engine.distributed.spawn import reap

        if self.closed:
            return
        if self.iid != 0:
            if self.rank == 0 and self.active:
                try:
                    self.call("close", None, lambda: {})
                except DistributedError:  # lost meanwhile: the worker set's failure says so
                    pass
            self.active = False
            self.closed = True
            return
        if self.rank == 0 and self.active and self.failure is None:
            try:
                self.call("shutdown", None, lambda: {})
            except Exception:  # noqa: BLE001 - lost while shutting down: reap below
                pass
        self.active = False
        self.closed = True
        self._link.closed = True
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.procs:
            lost = self.failure is not None
            reap(self.procs, 0.5 if lost else 15.0, kill=lost)
        self.group.close()


class DriverWorker:
    """Rank 0's worker as the engine sees it: :meth:`execute` runs the step on every rank
    (the local worker's logits are the step's: rank 0 holds the gathered vocabulary). Every
    other attribute is the local :class:`~xllm_vmm.engine.worker.Worker`'s."""

    def __init__(self, local: Any, runtime: Runtime) -> None:
        self.local = local
        self.runtime = runtime

    def execute(self, step: StepInput) -> StepOutput:
        from xllm_vmm.engine.distributed.comm_stats import COMM

        box: dict[str, Any] = {}
        t0 = time.perf_counter()
        before = COMM.snapshot()

        def run() -> dict:
            box["out"] = self.local.execute(step)
            return {}

        self.runtime.call("step", (list(step.chunks), int(step.block_size)), run)
        self.runtime.record_step(time.perf_counter() - t0, before, COMM.snapshot())
        return box["out"]

    def close(self) -> None:
        try:
            self.runtime.close()
        finally:
            self.local.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.local, name)


__all__ = ["DIST_OPTIONS", "DriverWorker", "Runtime", "runtime_for"]
