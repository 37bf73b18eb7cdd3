"""Serving across devices: one process per device over ``torch.distributed``.

- :mod:`.topology` — who is who from the engine's flags (``nnodes``, ``node_rank``,
  ``master_node_addr``), what is refused (no torch);
- :mod:`.group` — rendezvous, backend (gloo / NCCL / HCCL), heartbeats and the watchdog;
- :mod:`.sharding` — what each worker loads of a checkpoint (the shard hook);
- :mod:`.vocab` — vocabulary-parallel embedding and LM head;
- :mod:`.runtime` — the rank-0 driver ↔ worker protocol, faults, shutdown;
- :mod:`.fanout` — slot activation on every worker, all or nothing;
- :mod:`.spawn`, :mod:`.follower` — starting the other workers of one command.

Nothing here runs at world size 1: :func:`runtime_for` returns None.
"""

from __future__ import annotations

from typing import Any

from xllm_vmm.engine.distributed.errors import DistributedError, WorkerLost
from xllm_vmm.engine.distributed.topology import DIST_OPTIONS, Topology, topology_of


def runtime_for(*args: Any, **kw: Any):
    """See :func:`xllm_vmm.engine.distributed.runtime.runtime_for`."""
    from xllm_vmm.engine.distributed.runtime import runtime_for as f

    return f(*args, **kw)


__all__ = ["DIST_OPTIONS", "DistributedError", "Topology", "WorkerLost", "runtime_for",
           "topology_of"]
