"""Who is who in a multi-worker service, from the engine's flags (no torch here).

The engine's process model (``xllm_vmm.config.parallel``): ``nnodes`` processes, one device
each, ``node_rank`` this one, ``master_node_addr`` (``HOST:PORT``) where they meet. The world
size is ``nnodes × devices of one process``; every worker is one tensor-parallel rank
(``dp_size`` 1). Rank 0 runs the scheduler, the KV cache manager and — under ``serve`` — the
HTTP server on ``--port``; the other ranks run workers only and open no HTTP port. The port of
``master_node_addr`` is the rendezvous (a ``torch.distributed`` TCP store on rank 0's host).

Two ways to start a world of ``W > 1``:

- *launch script*: every process is started by the operator with ``--node_rank`` given
  (``R``), and they meet at ``master_node_addr``;
- *spawn*: one command without ``--node_rank`` (``LLM(model=DIR, nnodes=2)``, ``serve
  --nnodes=2``, or ``devices=cuda:0,cuda:1`` with ``nnodes=1``) is rank 0 and starts ranks
  ``1..W-1`` on this host itself (loopback; the rendezvous port is ``master_node_addr``'s when
  given explicitly, else a free one; rank ``r`` on the ``r``-th listed device, or on device
  index + ``r``), and tears them down with itself.

Supported: tensor parallelism over every worker, MoE experts split over ``ep_size``
expert-parallel groups (:mod:`.sharding`), and the host KV tier (its copies on every worker:
:mod:`.fanout`). Refused at start-up with the flag named:
``dp_size > 1`` (and ``ep_size > 1`` with it), MTP speculative decoding, several devices
listed for a process of a multi-process launch (one device per process there) — :func:`xllm_vmm.config.parallel.serve_refusals`, the same predicates
``check-config`` reports as the warning ``CFG-SERVE``.

Engine-only options (``LLMEngine.from_flags`` / ``LLM``; not catalogue flags):

- ``dist_timeout`` (seconds; default ``$XLLM_VMM_DIST_TIMEOUT``, else 120): every collective
  while serving (the bound a rank > 0 waits for rank 0);
- ``dist_heartbeat_timeout`` (seconds; default ``$XLLM_VMM_DIST_HEARTBEAT_TIMEOUT``, else
  ``min(10, dist_timeout / 2)``; must be below ``dist_timeout``): rank 0's watchdog calls a
  worker lost after this long without a heartbeat, and rank 0's step, waiting on that worker
  in a collective, ends then (:mod:`.deadline`) — a silent worker is detected in this time,
  not after the collective timeout;
- ``dist_startup_timeout`` (seconds; default ``$XLLM_VMM_DIST_STARTUP_TIMEOUT``, else 300):
  start-up — reaching the rendezvous, every rank arriving, every rank loading its weights
  (``serve`` reads both from the environment variables);
- ``worker_device_memory``: the emulated device size of every worker (host driver only; a list
  of sizes, one per rank). The plan (and so every worker's cache geometry) is rank 0's
  ``device_memory``; this changes only what each worker's device can physically hold, which is
  how admission by the smallest worker (AD-02) is rehearsed on one host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from xllm_vmm.config.parallel import spawns_per_device  # noqa: F401  (its home; re-exported)

DIST_OPTIONS = ("dist_timeout", "dist_heartbeat_timeout", "dist_startup_timeout",
                "worker_device_memory", "_spawned")
"""Engine-only options of the multi-worker runtime (``_spawned`` is set on spawned workers)."""

DEFAULT_TIMEOUT_S = 120.0
DEFAULT_STARTUP_TIMEOUT_S = 300.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Topology:
    """This process's place in the service. ``world`` workers, this one ``rank``;
    ``spawn``: rank 0 starts the others; ``host``/``port``: the rendezvous (port 0: pick a
    free loopback port, spawn only); ``timeout_s`` (collectives) and ``startup_timeout_s``:
    see the module docstring."""

    world: int
    rank: int
    spawn: bool
    host: str
    port: int
    timeout_s: float
    worker_device_memory: tuple[int, ...] = ()
    spawned: bool = False
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S
    heartbeat_timeout_s: float = 10.0
    ep: int = 1
    """Expert-parallel groups (``ep_size``; :mod:`.sharding`)."""

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def is_driver(self) -> bool:
        return self.rank == 0


def device_list(cfg: Any) -> list[str]:
    """The ``devices`` entries as written (``cuda:0``), in order."""
    return [d.strip() for d in str(cfg.get("devices", "") or "").split(",") if d.strip()]


def parse_master_addr(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) → (host, port); ValueError naming the flag."""
    s = str(text or "").strip()
    host, sep, port = s.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"master_node_addr={text!r} is not HOST:PORT (for example "
                         "127.0.0.1:19888)")
    return host, int(port)


def topology_of(cfg: Any, opts: dict[str, Any]) -> Topology | None:
    """The topology of a resolved configuration; None at world size 1 (one worker: nothing of
    this package runs). Raises :class:`~xllm_vmm.config.ConfigError` naming the flag for what
    is not supported (module docstring)."""
    from xllm_vmm.config import ConfigError, Finding
    from xllm_vmm.config.parallel import SERVE_REFUSES_ID, parallel_of, serve_refusals

    p = parallel_of(cfg)
    if p.world == 1:
        return None

    def refuse(flag: str, message: str, hint: str) -> ConfigError:
        return ConfigError([Finding("CFG-CONFLICT", "error", message,
                                    flags={flag: cfg[flag]}, hint=hint)])

    refusals = serve_refusals(cfg, p)  # the checker's CFG-SERVE (one home: config.parallel)
    if refusals:
        raise ConfigError([Finding(SERVE_REFUSES_ID, "error", message,
                                   flags={flag: cfg[flag]}, hint=hint)
                           for flag, message, hint in refusals])
    explicit = getattr(cfg, "explicit", lambda name: False)
    spawned = bool(opts.get("_spawned", False))
    spawn = not explicit("node_rank") and not spawned
    rank = 0 if spawn else int(cfg["node_rank"])
    if not 0 <= rank < p.world:
        raise refuse("node_rank", f"node_rank={rank} is outside 0..{p.world - 1} "
                     f"({p.describe()})", f"give a node_rank below {p.world}")
    try:
        host, port = parse_master_addr(cfg["master_node_addr"])
    except ValueError as e:
        raise refuse("master_node_addr", str(e), "give HOST:PORT of rank 0's host") from None
    if spawn and not explicit("master_node_addr"):
        host, port = "127.0.0.1", 0
    timeout = _seconds(opts, "dist_timeout", "XLLM_VMM_DIST_TIMEOUT", DEFAULT_TIMEOUT_S)
    startup = _seconds(opts, "dist_startup_timeout", "XLLM_VMM_DIST_STARTUP_TIMEOUT",
                       DEFAULT_STARTUP_TIMEOUT_S)
    heartbeat = _seconds(opts, "dist_heartbeat_timeout", "XLLM_VMM_DIST_HEARTBEAT_TIMEOUT",
                         min(DEFAULT_HEARTBEAT_TIMEOUT_S, timeout / 2))
    if heartbeat >= timeout:
        from xllm_vmm.config import ConfigError, Finding

        raise ConfigError([Finding(
            "CFG-CONFLICT", "error", f"dist_heartbeat_timeout={heartbeat:g} s must be below "
            f"dist_timeout={timeout:g} s (a silent worker is detected by its heartbeat before "
            "a collective times out)", flags={"dist_heartbeat_timeout": heartbeat},
            hint=f"give a heartbeat timeout below {timeout:g} s")])
    mem = _worker_memory(opts.get("worker_device_memory"), p.world)
    return Topology(p.world, rank, spawn, host, port, timeout, mem, spawned, startup, heartbeat,
                    p.ep)


def _seconds(opts: dict[str, Any], name: str, env_name: str, default: float) -> float:
    """A positive number of seconds: the option, else the environment variable, else
    ``default``; ConfigError naming the option (or the variable) otherwise."""
    import os

    from xllm_vmm.config import ConfigError, Finding

    value, where = opts.get(name), name
    if value is None:
        env = os.environ.get(env_name)
        where = env_name
        try:
            value = float(env) if env else default
        except ValueError:
            value = env
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError([Finding("CFG-TYPE", "error", f"{where}={value!r} must be a positive "
                                   "number of seconds", flags={name: value})])
    return float(value)


def _worker_memory(value: Sequence[Any] | None, world: int) -> tuple[int, ...]:
    from xllm_vmm.config import ConfigError, Finding
    from xllm_vmm.config.values import parse_size

    if value is None:
        return ()
    items = [value] if isinstance(value, (str, int)) else list(value)
    out = []
    for v in items:
        try:
            n = v if isinstance(v, int) and not isinstance(v, bool) else parse_size(str(v))
        except ValueError:
            n = -1
        if n <= 0:
            out = None
            break
        out.append(int(n))
    if out is None or len(out) != world:
        raise ConfigError([Finding("CFG-TYPE", "error", f"worker_device_memory={value!r} must "
                                   f"list {world} positive sizes, one per worker",
                                   flags={"worker_device_memory": value},
                                   hint="for example ['1GiB', '256MiB']")])
    return tuple(out)
