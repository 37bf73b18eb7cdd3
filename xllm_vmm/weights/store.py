"""``WeightStore``: the physical side of one checkpoint loaded into one VMM pool, shared by
every instance (:class:`~xllm_vmm.weights.model_weights.ModelWeights`) that uses it.

It owns:

- a *region* of the pool: tenant ``weights`` (``weights.1``, ... for further checkpoints in the
  same pool), carved from the high end of the arena (KV grows from the low end; VMM-02: one
  budget). The region's virtual addresses never move: every tensor is a view at a fixed offset
  (:mod:`xllm_vmm.weights.image`), created once and valid across sleep and wakeup;
- the *host copy* (``driver.alloc_host``: pinned where the device has it), the image byte for
  byte, when kept; a wakeup from it is one batched host-to-device copy;
- the *holders*: the instances over it and their states.

Reference counting (fork): the pages are mapped while at least one holder is awake
(``WAKEUP``) and released when the last awake holder sleeps; the host copy is kept while some
holder is awake or in light sleep and ``keep_host_copy`` is on, or while one is in light sleep
(a light sleep makes one by a device-to-host copy if the store kept none), and dropped when
every holder is in deep sleep or closed. So sleeping one instance never releases pages another
awake instance uses, and a fork of the same checkpoint maps nothing new.

Wakeup is all or nothing. From the host copy, the pages are mapped :data:`WAKE_BATCH_BYTES` at a
time and each batch's host-to-device copy starts as soon as it is mapped, so copying one batch
overlaps creating and mapping the next (the kernel zeroing fresh pages on the host driver,
``cuMemCreate``/``cuMemMap`` on a device); the budget is checked for the whole region before
the first batch, and if a batch cannot be mapped or a copy fails, every copy is waited for and
everything mapped is unmapped again. From the checkpoint files (checked unchanged first) the
pages are mapped in one batched pool call (rolled back by the pool on failure), then filled; if
filling fails, the pages are unmapped again and any host copy this attempt made is freed.

Modes of the pool: elastic (weights sleep gives memory back); physical (weight-only VMM:
VMM-03 keeps the KV cache physical, W-03 makes the weights elastic, so the region is a *paged*
tenant of the physical pool and sleep gives its memory back too); fixed (both VMM flags,
``vmm_elastic=false``: the pages stay backed, a sleep frees 0 bytes and says so; contents are
restored on wakeup all the same). Without a pool there is no weight VMM (W-02).

Units: bytes; ``seconds`` are wall-clock seconds (``time.perf_counter``).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Callable

from xllm_vmm.pool.pool import Region, VmmPool
from xllm_vmm.vmm.driver import CopyKind, VmmError, VmmOutOfMemory
from xllm_vmm.weights.errors import (WakeupFailed, WakeupOutOfMemory, WeightsError,
                                     WeightsOutOfMemory)
from xllm_vmm.weights.image import WeightImage
from xllm_vmm.weights.phases import PhaseClock

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["WeightStore", "TENANT", "WEIGHTS_TAG", "COPY_CHUNK_BYTES", "WAKE_BATCH_BYTES"]

TENANT = "weights"
WEIGHTS_TAG = "weights"
#: Largest single entry of a batched host<->device copy, and the staging window without a host
#: copy (bytes).
COPY_CHUNK_BYTES = 64 << 20
#: Pages a wakeup from the host copy maps per pool call before starting their copy (bytes;
#: whole pages, at least one).
WAKE_BATCH_BYTES = 64 << 20
_HOST_ALIGN = 4096


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


class WeightStore:
    """See the module docstring. Every public method holds the store's lock."""

    def __init__(self, pool: VmmPool, image: WeightImage, *, keep_host_copy: bool) -> None:
        if getattr(pool.driver, "name", "") == "sim" or not hasattr(pool.driver, "alloc_host"):
            raise ValueError(
                f"load_weights(pool=...): the pool's driver {pool.driver!r} has no memory behind "
                "its addresses (the simulated driver does bookkeeping only); use a pool over "
                "open_driver('host'), the ACL or the CUDA driver")
        self.pool = pool
        self.driver = pool.driver
        self.image = image
        self.keep_host_copy = keep_host_copy
        self.lock = threading.RLock()
        n = 0
        name = TENANT
        while pool.has_tenant(name):
            n += 1
            name = f"{TENANT}.{n}"
        self.tenant = name
        self.region: Region = pool.add_tenant(name, image.nbytes, end="high", paged=True)
        self.pages = list(range(self.region.pages))
        self.host_addr: int | None = None
        self.host_bytes = 0
        self.mapped = False
        self.holders: list = []  # ModelWeights, in creation order
        self.tensors: dict[str, "torch.Tensor"] = {}
        self._region_view: "torch.Tensor | None" = None
        self.closed = False

    # -- properties ---------------------------------------------------------------------
    @property
    def vmm(self) -> bool:
        """Weights in a pool are weight VMM: sleep, wakeup and fork are allowed."""
        return True

    @property
    def device_bytes(self) -> int:
        """Bytes of the region (whole pages)."""
        return self.region.nbytes

    # -- load ---------------------------------------------------------------------------
    def load(self, progress: Callable[[int, int], None] | None) -> None:
        """Maps the region and fills it from the checkpoint; builds the tensor views. On any
        failure everything is given back (pages, host copy, the region) and the error raised."""
        try:
            self._map_or_raise("load")
            self._fill_from_files(progress)
            self.mapped = True
            self._build_views()
        except BaseException:
            self._unmap()
            self._free_host()
            self.pool.remove_tenant(self.tenant)
            self.closed = True
            raise

    def _build_views(self) -> None:
        from xllm_vmm.vmm.tensor import view

        import torch

        region = view(self.driver, self.region.base_va, self.region.nbytes, torch.uint8)
        self._region_view = region
        from xllm_vmm.weights.checkpoint import torch_dtype

        for p in self.image.placed:
            t = region[p.offset:p.offset + p.nbytes].view(torch_dtype(p.dtype)).view(p.shape)
            self.tensors[p.name] = t

    # -- pages --------------------------------------------------------------------------
    def _map_or_raise(self, action: str, state: str = "DEEP_SLEEP",
                      clock: PhaseClock | None = None) -> None:
        """Maps every page of the region in one pool call (all or nothing), else raises
        :class:`WeightsOutOfMemory` (load) / :class:`WakeupOutOfMemory` (wakeup) with what
        the pool could take. ``clock`` gets ``map`` (the driver's batched map) and ``commit``
        (the rest of the pool call: creating the physical pages)."""
        pool, need, page = self.pool, self.region.nbytes, self.region.page_bytes
        available = pool.mappable_pages(self.region) * page
        t0, map0 = time.perf_counter(), pool.map_seconds
        ok = pool.map_pages(self.region, self.pages, tag=WEIGHTS_TAG)
        if clock is not None:
            mapped = pool.map_seconds - map0
            clock.add("map", mapped)
            clock.add("commit", time.perf_counter() - t0 - mapped)
        if ok:
            return
        raise self._map_failure(action, state, available)

    def _map_failure(self, action: str, state: str, available: int) -> WeightsOutOfMemory:
        """The error for a map of the region that failed, ``available`` bytes being what the
        pool could map before it."""
        need, page = self.region.nbytes, self.region.page_bytes
        cause = ("the budget refused it (free memory − execution peak − reserve, and the "
                 "quota)" if available < need else "the device ran out of memory part way")
        available = min(available, need - page)
        if action == "load":
            return WeightsOutOfMemory("load", needed_bytes=need, available_bytes=available,
                                      page_bytes=page, cause=cause)
        return WakeupOutOfMemory(needed_bytes=need, available_bytes=available, page_bytes=page,
                                 state=state, cause=cause)

    def _map_and_restore(self, state: str, clock: PhaseClock) -> None:
        """Wakeup from the host copy, batch by batch with the copies overlapping the maps (see
        the module docstring); all or nothing. ``clock`` gets ``commit`` and ``map`` (the pool
        calls) and ``copy`` (waiting for the copies after the last batch is mapped: the part
        of the copy that the maps did not hide)."""
        pool, region, page = self.pool, self.region, self.region.page_bytes
        available = pool.mappable_pages(region) * page
        if available < region.nbytes:  # refused before anything is mapped
            raise self._map_failure("wakeup", state, available)
        per = max(1, WAKE_BATCH_BYTES // page)
        mapped: list[int] = []
        transfers: list = []
        error: BaseException | None = None
        try:
            for i in range(0, len(self.pages), per):
                batch = self.pages[i:i + per]
                t0, map0 = time.perf_counter(), pool.map_seconds
                ok = pool.map_pages(region, batch, tag=WEIGHTS_TAG)
                took = pool.map_seconds - map0
                clock.add("map", took)
                clock.add("commit", time.perf_counter() - t0 - took)
                if not ok:
                    error = self._map_failure("wakeup", state, available)
                    break
                mapped.extend(batch)
                lo, hi = batch[0] * page, min(self.image.nbytes, (batch[-1] + 1) * page)
                if lo < hi:
                    vas, offs, sizes = self._chunks(lo, hi)
                    transfers.append(self.driver.copy_batch_async(
                        vas, [self.host_addr + o for o in offs], sizes, CopyKind.H2D))
        except BaseException as exc:
            error = exc
        with clock.phase("copy"):
            for t in transfers:
                try:
                    t.wait()
                except BaseException as exc:  # the first error wins
                    error = error or exc
        if error is None:
            return
        if mapped:
            self.driver.synchronize()
            pool.unmap_pages(region, mapped, tag=WEIGHTS_TAG, release=True)
        raise error

    def _unmap(self, clock: PhaseClock | None = None) -> int:
        """Takes the region's pages out of use; returns the device bytes really freed.
        ``clock`` gets ``sync``, ``unmap`` (the driver's batched unmap) and ``release`` (the
        rest of the pool call: freeing the physical pages)."""
        clock = clock or PhaseClock()
        pool = self.pool
        in_use = pool.pages_in_use(self.region)
        if not in_use:
            self.mapped = False
            return 0
        with clock.phase("sync"):
            self.driver.synchronize()
        held = pool.held_bytes
        pages = sorted(in_use)
        t0, unmap0 = time.perf_counter(), pool.unmap_seconds
        pool.unmap_pages(self.region, pages, tag=WEIGHTS_TAG, release=True)
        unmapped = pool.unmap_seconds - unmap0
        clock.add("unmap", unmapped)
        clock.add("release", time.perf_counter() - t0 - unmapped)
        self.mapped = False
        return held - pool.held_bytes

    # -- host copy ----------------------------------------------------------------------
    def _alloc_host(self) -> int:
        size = _round_up(self.image.nbytes, _HOST_ALIGN)
        addr = self.driver.alloc_host(size)
        self.host_addr, self.host_bytes = addr, size
        return addr

    def _free_host(self) -> int:
        if self.host_addr is None:
            return 0
        freed = self.host_bytes
        self.driver.free_host(self.host_addr)
        self.host_addr, self.host_bytes = None, 0
        return freed

    def _chunks(self, lo: int, hi: int) -> tuple[list[int], list[int], list[int]]:
        """(region addresses, offsets, sizes) of ``[lo, hi)`` in runs of COPY_CHUNK_BYTES."""
        vas, offs, sizes = [], [], []
        for off in range(lo, hi, COPY_CHUNK_BYTES):
            n = min(COPY_CHUNK_BYTES, hi - off)
            vas.append(self.region.base_va + off)
            offs.append(off)
            sizes.append(n)
        return vas, offs, sizes

    def _copy_d2h(self, host: int) -> None:
        vas, offs, sizes = self._chunks(0, self.image.nbytes)
        self.driver.copy_batch([host + o for o in offs], vas, sizes, CopyKind.D2H)

    def _fill_from_files(self, progress: Callable[[int, int], None] | None) -> None:
        """Reads the checkpoint into the mapped region, window by window (COPY_CHUNK_BYTES,
        or one larger tensor): each window is read into the host copy (when kept) or into one
        of two staging buffers, then copied host-to-device asynchronously while the next
        window is read. Waits for every copy before returning or raising."""
        total = self.image.tensor_bytes
        done = [0]

        def tick(n: int) -> None:
            done[0] += n
            if progress is not None:
                progress(done[0], total)

        if progress is not None:
            progress(0, total)
        windows = self.image.windows(COPY_CHUNK_BYTES)
        staging: list[int] = []
        if self.keep_host_copy:
            host = self._alloc_host()
        else:
            size = _round_up(max(hi - lo for lo, hi, _ in windows), _HOST_ALIGN)
            for _ in range(min(2, len(windows))):
                staging.append(self.driver.alloc_host(size))
        pending: list = [None] * max(1, len(staging))
        files: dict = {}
        error: BaseException | None = None
        try:
            for k, (lo, hi, placed) in enumerate(windows):
                if staging:
                    slot = k % len(staging)
                    if pending[slot] is not None:  # the buffer's previous copy must be done
                        t, pending[slot] = pending[slot], None
                        t.wait()
                    buf, base = staging[slot], lo
                else:
                    slot, buf, base = 0, host, 0
                self.image.fill(buf, placed, base=base, span=(lo, hi), progress=tick,
                                files=files)
                t = self.driver.copy_batch_async([self.region.base_va + lo], [buf + lo - base],
                                                 [hi - lo], CopyKind.H2D)
                if staging:
                    pending[slot] = t
                else:
                    pending.append(t)
        except BaseException as exc:
            error = exc
        finally:
            for fh in files.values():
                fh.close()
            for t in pending:
                if t is None:
                    continue
                try:
                    t.wait()
                except BaseException as exc:  # the first error wins
                    error = error or exc
            for addr in staging:
                self.driver.free_host(addr)
        if error is not None:
            raise error
        if progress is not None:
            progress(total, total)

    # -- transitions (called by ModelWeights with the lock held) ---------------------------
    def awake_holders(self, but=None) -> int:
        return sum(1 for h in self.holders if h is not but and h._state == "WAKEUP")

    def light_holders(self, but=None) -> int:
        return sum(1 for h in self.holders if h is not but and h._state == "LIGHT_SLEEP")

    def release_for_sleep(self, holder, level: int,
                          clock: PhaseClock | None = None) -> tuple[int, int]:
        """``holder`` goes to sleep at ``level`` (1 light, 2 deep): returns (device bytes,
        host bytes) freed. The pages go when no other holder is awake; before that, a host
        copy is made (device-to-host) if a light sleeper needs one and none is kept. Raises,
        with nothing changed, when that copy cannot be made. ``clock``: the phases
        (:mod:`xllm_vmm.weights.phases`)."""
        clock = clock or PhaseClock()
        device = host = 0
        others_awake = self.awake_holders(but=holder)
        lights = self.light_holders(but=holder) + (level == 1)
        if not others_awake and self.mapped:
            if lights and self.host_addr is None:
                try:
                    addr = self._alloc_host()
                except VmmError as exc:
                    raise WeightsError(
                        f"light sleep keeps a host copy of {self.image.nbytes} bytes and the "
                        f"host has no room for it ({exc}); use deep sleep (level 2), which "
                        "reloads from the checkpoint on wakeup") from exc
                try:
                    with clock.phase("host_copy"):
                        self._copy_d2h(addr)
                except BaseException:
                    self._free_host()
                    raise
            device = self._unmap(clock)
        keep_host = lights > 0 or (others_awake > 0 and self.keep_host_copy)
        if not keep_host:
            with clock.phase("host_free"):
                host = self._free_host()
        return device, host

    def acquire_for_wake(self, holder, clock: PhaseClock | None = None) -> tuple[str, int]:
        """``holder`` wakes up: maps and fills the pages unless another holder keeps them
        mapped. Returns (source, device bytes mapped); source is ``"shared"`` (already
        mapped), ``"host_copy"`` or ``"checkpoint"``. All or nothing (see the module).
        ``clock``: the phases (:mod:`xllm_vmm.weights.phases`)."""
        clock = clock or PhaseClock()
        if self.mapped:
            return "shared", 0
        state = holder._state
        if self.host_addr is None:
            with clock.phase("check"):
                self.image.checkpoint.check_unchanged()
        held = self.pool.held_bytes
        if self.host_addr is None:
            self._map_or_raise("wakeup", state, clock)
        made_host = False
        try:
            if self.host_addr is not None:
                source = "host_copy"
                self._map_and_restore(state, clock)
            else:
                source = "checkpoint"
                made_host = self.keep_host_copy
                with clock.phase("reload"):
                    self._fill_from_files(None)
        except BaseException as exc:
            self._unmap()
            if made_host:
                self._free_host()
            if isinstance(exc, VmmOutOfMemory):
                raise WakeupFailed(f"no host memory for the reload ({exc})", state=state) from exc
            if isinstance(exc, (VmmError, OSError)):
                raise WakeupFailed(f"restoring the weights failed ({exc})", state=state) from exc
            raise
        self.mapped = True
        if not self.keep_host_copy and not self.light_holders(but=holder):
            self._free_host()  # made by a light sleep; nobody needs it while awake
        return source, self.pool.held_bytes - held

    def close_holder(self, holder) -> None:
        """Drops ``holder``; the last one gives everything back (pages, host copy, region).
        A closing holder that was the last awake one releases the pages like a deep sleep
        (keeping a host copy for light sleepers; if none can be made they reload from the
        checkpoint)."""
        if holder not in self.holders:
            return
        if holder._state == "WAKEUP":
            try:
                self.release_for_sleep(holder, 2)
            except WeightsError:
                self._unmap()
        self.holders.remove(holder)
        if self.holders and not (self.light_holders()
                                 or (self.awake_holders() and self.keep_host_copy)):
            self._free_host()  # nobody left needs the host copy (the same rule as a sleep)
        if not self.holders and not self.closed:
            self.tensors.clear()
            self._region_view = None
            self._unmap()
            self._free_host()
            self.pool.remove_tenant(self.tenant)
            self.closed = True
