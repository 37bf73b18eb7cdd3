"""How the engine's process and parallel flags combine: the one home of the worker count.

From the engine's source (``xllm/core/distributed_runtime/dist_manager.cpp``,
``framework/parallel_state/collective_communicator.cpp``, ``platform/device_name_utils.cpp``):

- one engine process serves the devices in its ``devices`` list (``npu:0`` or ``npu:0,npu:1``:
  one worker each); ``nnodes`` is the number of such processes in the whole service (the CLI
  reference: "the total number of devices used by the current service" with the usual one
  device per process), ``node_rank`` this process's place among them (0..nnodes-1; its workers
  take the global ranks from ``node_rank × len(devices)``);
- the world size is ``W = len(devices) × nnodes``; the engine checks ``W % dp_size == 0`` and
  each data-parallel group is tensor parallel over ``tp = W / dp_size`` workers
  (``dp_local_tp_size``: attention, dense layers and the KV heads are split ``tp`` ways);
- MoE experts are split ``ep_size`` ways and each expert ``W / ep_size`` ways: the engine checks
  ``(W / ep_size) × ep_size == W``;
- ``tp_size`` is read by the DiT backend only (``backend=dit``); for language models the
  tensor-parallel degree is ``W / dp_size`` whatever ``tp_size`` says.

``devices`` empty or ``auto`` lets the engine use every device it sees: unknown here, counted
as one per process (the usual launch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Parallel:
    """The worker count of one service.

    ``per_process``: devices (workers) of one process; ``nnodes``: processes; ``world``:
    every worker of the service (``per_process × nnodes``); ``dp``: data-parallel groups;
    ``tp``: workers of one group (``world // dp``; the KV heads and dense weights are split
    ``tp`` ways); ``ep``: expert-parallel groups; ``devices_known``: False when ``devices`` is
    empty or ``auto`` (one device per process assumed)."""

    per_process: int
    nnodes: int
    world: int
    dp: int
    tp: int
    ep: int
    devices_known: bool

    def describe(self) -> str:
        """``nnodes 16 × 1 device(s) per process = 16 workers, dp_size 1: tensor parallel 16``."""
        return (f"nnodes {self.nnodes} × {self.per_process} device(s) per process = "
                f"{self.world} worker(s), dp_size {self.dp}: tensor parallel {self.tp}")


def parallel_of(cfg: Any) -> Parallel:
    """The :class:`Parallel` of a resolved configuration (anything with ``cfg["flag"]``).
    Raises ValueError for a ``devices`` list that is not valid (the message names the entry).
    ``tp`` is ``world // dp`` (at least 1) even when ``dp`` does not divide ``world``
    (:func:`parallel_problems` reports that)."""
    from xllm_vmm.config.values import parse_devices

    listed = parse_devices(str(cfg.get("devices", "") or ""))
    per = len(listed) or 1
    nnodes = max(1, int(cfg.get("nnodes", 1) or 1))
    dp = max(1, int(cfg.get("dp_size", 1) or 1))
    ep = max(1, int(cfg.get("ep_size", 1) or 1))
    world = per * nnodes
    return Parallel(per, nnodes, world, dp, max(1, world // dp), ep, bool(listed))


def parallel_problems(cfg: Any, p: Parallel) -> list[tuple[str, str, tuple[str, ...], str]]:
    """What the engine refuses or ignores in ``p``: ``(severity, message, flags, hint)`` each.

    Errors (the engine's CHECKs fail at start-up): ``dp_size`` that does not divide the world
    size; ``ep_size`` that does not divide it. Warning: an explicit ``tp_size`` other than
    ``world / dp_size`` outside the DiT backend (the engine ignores it)."""
    out = []
    if p.world % p.dp:
        out.append(("error", f"dp_size={p.dp} does not divide the {p.world} workers of the "
                             f"service ({p.describe().split(', dp_size')[0]}): the engine checks "
                             f"that the world size is a multiple of dp_size",
                    ("dp_size", "nnodes", "devices"),
                    f"set dp_size to a divisor of {p.world}, or change nnodes/devices"))
    if p.ep > 1 and p.world % p.ep:
        out.append(("error", f"ep_size={p.ep} does not divide the {p.world} workers of the "
                             "service: the engine checks (world / ep_size) × ep_size == world",
                    ("ep_size", "nnodes", "devices"),
                    f"set ep_size to a divisor of {p.world}"))
    explicit = getattr(cfg, "explicit", None)
    backend = str(cfg.get("backend", "") or "").strip().lower()
    tp_size = int(cfg.get("tp_size", 1) or 1)
    if explicit is not None and explicit("tp_size") and backend != "dit" and tp_size != p.tp:
        out.append(("warning", f"tp_size={tp_size} is read by the engine only for the DiT "
                               f"backend (backend=dit); this service is tensor parallel over "
                               f"{p.tp} worker(s) ({p.describe()})",
                    ("tp_size", "nnodes", "devices", "dp_size"),
                    "remove tp_size; the worker count is nnodes × the devices of one process "
                    "(one process per device), divided by dp_size"))
    return out


#: The finding id of what ``xllm-vmm serve`` refuses across workers although the engine runs it.
SERVE_REFUSES_ID = "CFG-SERVE"


def spawns_per_device(cfg: Any) -> bool:
    """True when one command lists several ``devices`` with ``nnodes=1`` and no
    ``node_rank``: it is rank 0 on the first device and spawns one worker per other device
    (the way ``serve`` runs several devices from one process). False for a ``devices`` list
    that is not valid (the checker reports that as CFG-TYPE)."""
    from xllm_vmm.config.values import parse_devices

    explicit = getattr(cfg, "explicit", lambda name: False)
    try:
        n = len(parse_devices(str(cfg.get("devices", "") or "")))
    except ValueError:
        return False
    return n > 1 and int(cfg.get("nnodes", 1) or 1) == 1 and not explicit("node_rank")


def serve_refusals(cfg: Any, p: Parallel | None = None) -> list[tuple[str, str, str]]:
    """What ``xllm-vmm serve`` (and ``LLM``/``LLMEngine``) refuses in a service of several
    workers although the engine itself runs it: ``(flag, message, hint)`` each, in this order;
    empty at one worker (``p.world == 1``: nothing of the multi-worker runtime runs).

    The one home of these predicates: ``check-config`` reports each as :data:`SERVE_REFUSES_ID`
    (a warning; an error with ``--strict``; ``plan`` lists it among ``serve_refuses``) and the
    distributed start-up (``engine.distributed.topology``) raises them. Refused: ``dp_size > 1``
    (every worker is one tensor-parallel rank); ``ep_size > 1`` together with ``dp_size > 1``
    (expert groups that span data-parallel groups need an all-to-all between them; ``ep_size``
    alone is supported: each expert group holds its experts, combined by the layer's
    all-reduce — the model's expert count is checked at start-up); MTP speculative decoding
    (``num_speculative_tokens > 0``: its draft runs on one worker only); several ``devices`` for one process of a multi-process
    launch (``nnodes > 1`` or a ``node_rank``: one device per process there; one command with
    several devices, ``nnodes=1`` and no ``node_rank`` spawns one worker per device and is
    supported). The host KV tier (``host_blocks_factor > 0``) is supported: its copies run on
    every worker (``engine.distributed.fanout``).
    ``cfg``: anything with ``cfg.get(flag)`` (and ``cfg.explicit(flag)`` when known)."""
    p = p if p is not None else parallel_of(cfg)
    if p.world == 1:
        return []
    out = []
    if p.dp > 1:
        out.append(("dp_size", f"dp_size={p.dp}: data parallelism across workers is not "
                    "supported by xllm-vmm serve (every worker is one tensor-parallel rank; "
                    f"{p.world} workers): it needs one scheduler and block-table space per "
                    "data-parallel group and a front that routes requests between the groups",
                    "remove dp_size (tensor parallel over all nnodes x devices workers), or "
                    "run one service per data-parallel group"))
    if p.ep > 1 and p.dp > 1:
        out.append(("ep_size", f"ep_size={p.ep} with dp_size={p.dp}: expert groups that span "
                    "data-parallel groups need an all-to-all between the groups, which "
                    "xllm-vmm serve does not have (ep_size alone is supported: each expert "
                    "group holds its experts and the layer's all-reduce combines them)",
                    "remove dp_size (tensor parallel over every worker, experts split "
                    "ep_size ways)"))
    spec = int(cfg.get("num_speculative_tokens", 0) or 0)
    if spec > 0:
        out.append(("num_speculative_tokens", f"num_speculative_tokens={spec}: MTP "
                    f"speculative decoding runs on one worker in xllm-vmm serve, not across "
                    f"{p.world}", "set num_speculative_tokens=0, or serve on one device"))
    if p.per_process > 1 and not spawns_per_device(cfg):
        out.append(("devices", f"devices={cfg.get('devices')} with nnodes={p.nnodes} or a "
                    "node_rank: under xllm-vmm serve a process of a multi-process launch "
                    "serves one device",
                    "give each process one device (nnodes = the number of devices), or start "
                    "one command with several devices, nnodes=1 and no node_rank"))
    return out


def fork_refusals(cfg: Any, p: Parallel | None = None) -> list[tuple[str, str, str]]:
    """What ``LLMEngine.fork`` (and the admin ``/fork`` route) refuses in a service of several
    workers: ``(flag, message, hint)`` each; empty at one worker. The one home of this
    predicate: the distributed fork (``engine.distributed.runtime.Runtime.fork_view``) raises
    it before anything is built.

    A fork across workers forks every worker's weight shard (its pages shared, no byte
    copied) and builds the fork's own KV cache and pool on every worker, over the worker
    set's one command channel (tested with 2 workers: Llama and Qwen3, the VMM KV cache
    elastic with the prefix cache and fixed without it). Refused: the host KV tier (``host_blocks_factor > 0``): a
    fork's tier copies would fan out over the same channel, which no test covers yet."""
    p = p if p is not None else parallel_of(cfg)
    if p.world == 1:
        return []
    out = []
    factor = float(cfg.get("host_blocks_factor", 0) or 0)
    if factor > 0:
        out.append(("host_blocks_factor", f"host_blocks_factor={factor:g}: fork across "
                    f"{p.world} workers with the host KV tier is not supported by xllm-vmm "
                    "(the fork's host-tier copies on every worker are not implemented)",
                    "set --host_blocks_factor=0 to fork across workers, or fork a "
                    "single-worker engine"))
    return out
