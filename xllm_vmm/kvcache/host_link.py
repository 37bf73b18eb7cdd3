"""The KV cache manager's wiring to the host KV tier (HK-01): building the tier for a cache
(:func:`build_host_tier`: HK-02/HK-03 no tier, HK-05 refused, HK-06 sized, HK-07 checked) and
what the manager's verbs do with it (:class:`HostLink`): a lookup's host blocks held by pins,
restores into a request's blocks started, finished and cancelled, and write-through offloads
of blocks that became cached. The host tier itself (copies in flight, the host pool) is
:mod:`xllm_vmm.kvcache.host_tier`; the manager holds it as ``KVCacheManager.host``.
Units: blocks, tokens, bytes.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from xllm_vmm.kvcache.hashing import BlockHash
from xllm_vmm.kvcache.host_pool import HostPool, check_host_pool_fits
from xllm_vmm.kvcache.host_support import host_tier_unsupported_reason
from xllm_vmm.kvcache.host_tier import HostTier, Restore
from xllm_vmm.kvcache.prefix_setup import HostTierUnsupported, KvBlockAddresses, plan_host_pool
from xllm_vmm.kvcache.records import NO_HOST, RequestRecord, set_upto

__all__ = ["HostLink", "build_host_tier"]


class HostLink:
    """The manager's side of the host tier ``tier``: host hits held, restores in flight
    (``restoring``: request id → record, the same dict the manager reads), offloads."""

    __slots__ = ("tier", "block_size", "restoring", "restore_failures")

    def __init__(self, tier: HostTier, block_size: int) -> None:
        self.tier = tier
        self.block_size = block_size
        self.restoring: dict[str, RequestRecord] = {}  # requests with a restore in flight
        self.restore_failures = 0

    # -- a lookup's host blocks ------------------------------------------------------------
    def hold(self, req: RequestRecord, hashes: Sequence[BlockHash], n_dev: int, cap: int) -> int:
        """The host tier's consecutive blocks after ``n_dev`` device blocks (at most ``cap``
        blocks in all), pinned in the host pool for ``req`` until :meth:`unhold`; returns how
        many."""
        tier = self.tier
        n_host = tier.match(hashes, n_dev, max_blocks=cap)
        pool = tier.pool
        held = []
        for h in hashes[n_dev:n_dev + n_host]:
            hb = pool.lookup(h)
            pool.pin(hb)  # type: ignore[arg-type]
            held.append(hb)
        if held:
            req.held_host = held  # type: ignore[assignment]
        return n_host

    def unhold(self, req: RequestRecord) -> None:
        """The lookup's hold on host blocks ends (a restore pins what it reads itself)."""
        pool = self.tier.pool
        for hb in req.held_host:
            pool.unpin(hb)
        req.held_host = NO_HOST

    # -- restores --------------------------------------------------------------------------
    def start_restore(self, req: RequestRecord, n_dev: int, n_host: int,
                      new: Mapping[str, list[int]]) -> None:
        """Restore the ``n_host`` blocks after the device hit into the first ``n_host`` of the
        request's ``new`` blocks (per group); ``ready`` is false until it ends."""
        r = self.tier.restore(req.hashes[n_dev:n_dev + n_host], n_dev,
                              {g: ids[:n_host] for g, ids in new.items()})
        r.update(req)  # positions that joined another restore in flight
        req.restore = r
        self.restoring[req.rid] = req

    def finish(self, req: RequestRecord, r: Restore) -> None:
        """Restore ``r`` of ``req`` ended: success publishes the restored blocks (the hit
        stands); failure drops ``num_computed`` back to the device hit."""
        req.restore = None
        self.restoring.pop(req.rid, None)
        bs = self.block_size
        if r.ok:
            req.published = max(req.published, r.first_block + r.num_blocks)
        else:
            self.restore_failures += 1
            req.num_computed = r.first_block * bs  # the device hit
            req.published = min(req.published, r.first_block)
        req.publish_at = (req.published + 1) * bs
        set_upto(req)

    def cancel(self, req: RequestRecord) -> None:
        """``req`` is freed with its restore in flight."""
        req.restore.cancel()  # type: ignore[union-attr]
        req.restore = None
        self.restoring.pop(req.rid, None)

    # -- progress --------------------------------------------------------------------------
    def offload(self, hashes: list[BlockHash]) -> None:
        """Write-through: hashes whose blocks just became cached go to the host tier."""
        if hashes:
            self.tier.offload(hashes)

    def step(self) -> None:
        """Copies progress (finished copies release their pins, queued offloads go out as one
        batch); finished restores are applied."""
        self.tier.step()
        for req in [q for q in self.restoring.values() if q.restore.finished]:  # type: ignore[union-attr]
            self.finish(req, req.restore)  # type: ignore[arg-type]

    def reap(self) -> bool:
        """Finished copies unpin their blocks now; ``True`` when copies were in flight (an
        allocation may then find more to evict)."""
        if not self.tier.in_flight:
            return False
        self.tier.poll()
        return True


def build_host_tier(cache: Any, prefix: Any, layout: Any, host_blocks_factor: float, *,
                    vision: bool, driver: Any, tuning: Mapping[str, Any]) -> HostTier | None:
    """The host tier of ``cache`` (HK-01) when prefix caching is on and
    ``host_blocks_factor > 1`` (HK-02/HK-03: none otherwise): refused for a layout it cannot
    copy (HK-05, :class:`HostTierUnsupported`), sized by HK-06 and checked against host memory
    (HK-07, ``tuning["host_available_bytes"]``); ``tuning["host_populate"]`` commits the host
    pool's pages at start. A refusal after the host pool was made closes it."""
    if prefix is None or host_blocks_factor <= 1:
        return None
    reason = host_tier_unsupported_reason(layout, vision=vision)
    if reason:
        raise HostTierUnsupported(f"{reason}; set host_blocks_factor=0 (or <= 1) to "
                                  "run without the host tier")
    size = plan_host_pool(cache, host_blocks_factor)  # HK-06
    check_host_pool_fits(size, tuning.get("host_available_bytes"))  # HK-07
    hpool = HostPool(size, driver, populate=tuning.get("host_populate", True))
    try:
        return HostTier(prefix, hpool, driver, KvBlockAddresses(cache))
    except BaseException:
        hpool.close()
        raise
