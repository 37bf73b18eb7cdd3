"""Helpers to run the manager's stack (prefix cache, host tier, VirtualKVCache) on a real
driver (the host driver; the ACL emulation where it can be opened), through its verbs."""

from __future__ import annotations

import ctypes

import pytest

from tests.prefix.fakes import Req  # one request record for the fake and the real stack
from xllm_vmm.kvcache import build_kv_cache_manager
from xllm_vmm.kvcache.hashing import block_hashes
from xllm_vmm.models.spec import CacheGroup, CacheLayout, CacheTensor
from xllm_vmm.pool.budget import BudgetConfig, BudgetMode
from xllm_vmm.pool.pool import VmmPool
from xllm_vmm.vmm import CopyKind, VmmError, VmmUnavailable, open_driver

MiB = 1 << 20
BS = 4


def open_test_driver(kind: str, device_memory: int):
    try:
        if kind == "host":
            return open_driver("host", device_memory=device_memory)
        if kind == "acl-emu":
            return open_driver("acl", library="emulation", device_memory=device_memory)
    except (VmmUnavailable, ImportError) as e:  # the ACL emulation is not built everywhere yet
        pytest.skip(f"{kind} driver unavailable here: {e}")
    raise AssertionError(kind)


def flat_layout(bytes_per_token=1 << 16):
    """One group of K and V; 2 MiB pages hold 8 blocks of 4 tokens at 64 KiB per token."""
    return CacheLayout("test-flat", 1, (CacheGroup(
        "attn", (CacheTensor("l0.k", bytes_per_token), CacheTensor("l0.v", bytes_per_token)),
        BS),))


def mla_index_layout():
    """MLA+INDEX: two groups of different widths (HK-05 supported)."""
    return CacheLayout("test-mla", 1, (
        CacheGroup("mla", (CacheTensor("l0.latent", 1 << 16), CacheTensor("l1.latent", 1 << 16)),
                   BS),
        CacheGroup("index", (CacheTensor("l0.index", 1 << 15),), BS),
    ))


class _StepTransfer:
    """A queued batch of :class:`StepCopies`: done once the queue ran it; ``wait`` runs the
    queue up to it (transfers complete in order, like a stream) and re-raises its error."""

    def __init__(self, owner: "StepCopies", run) -> None:
        self._owner, self._run = owner, run
        self.finished = False
        self.error: BaseException | None = None

    def done(self) -> bool:
        return self.finished

    def wait(self, timeout: float | None = None) -> None:
        while not self.finished:
            self._owner.complete(1)
        if self.error is not None:
            raise self.error


class StepCopies:
    """A real driver whose asynchronous copies run only when told: ``copy_batch_async``
    queues the batch; :meth:`complete` runs the oldest ``k`` for real (optionally failing the
    first of them without copying). Everything else is the real driver's. Timing never decides
    what a test sees."""

    def __init__(self, driver) -> None:
        self._driver = driver
        self._queue: list[_StepTransfer] = []

    def __getattr__(self, name):
        return getattr(self._driver, name)

    @property
    def queued(self) -> int:
        return len(self._queue)

    def copy_batch_async(self, dsts, srcs, sizes, kind):
        args = (list(dsts), list(srcs), list(sizes), kind)
        t = _StepTransfer(self, lambda: self._driver.copy_batch(*args))
        self._queue.append(t)
        return t

    def complete(self, k: int, *, fail_first: bool = False) -> int:
        """Runs the oldest ``k`` queued copies; returns how many ran."""
        ran = 0
        while self._queue and ran < k:
            t = self._queue.pop(0)
            try:
                if fail_first and ran == 0:
                    raise VmmError("copy_batch", 5, "injected copy failure")
                t._run()
            except Exception as e:  # noqa: BLE001 - the transfer carries it, like a device error
                t.error = e
            t.finished = True
            ran += 1
        return ran

    def complete_at(self, i: int, *, fail: bool = False) -> None:
        """Runs queued copy ``i`` (0 = the oldest) now, failing it instead when ``fail``."""
        t = self._queue.pop(i)
        try:
            if fail:
                raise VmmError("copy_batch", 5, "injected copy failure")
            t._run()
        except Exception as e:  # noqa: BLE001 - the transfer carries it, like a device error
            t.error = e
        t.finished = True

    def synchronize(self) -> None:
        self.complete(len(self._queue))


class RestoreView:
    """A request's host restore as the tests look at it, through the manager's verbs."""

    def __init__(self, stack: "Stack", req: Req) -> None:
        self._s, self._req = stack, req
        self.num_blocks = req.host

    def done(self) -> bool:
        return self._s.mgr.ready(self._req.rid)

    def wait(self) -> bool:
        """Runs the copies until the request is ready; ``True`` when the restore succeeded."""
        m = self._s.mgr
        while not m.ready(self._req.rid):
            m.host.wait_all()
        return m.num_computed_tokens(self._req.rid) == (self._req.hit + self.num_blocks) * BS

    def cancel(self) -> None:
        """Nothing to do: :meth:`Stack.finish` (the manager's ``free``) cancels it."""


class Stack:
    """driver → pool (elastic, ``budget`` bytes quota) → the manager's stack, built by
    :func:`build_kv_cache_manager` (VirtualKVCache → PrefixCache → HostTier). Requests go
    through the manager's verbs."""

    def __init__(self, kind: str, layout: CacheLayout, *, budget: int, max_tokens: int,
                 host_factor: float = 0.0, step_copies: bool = False) -> None:
        """``step_copies``: the host tier's asynchronous copies go through :class:`StepCopies`
        (``self.copies``) and run only when a test completes them."""
        self.driver = open_test_driver(kind, 256 * MiB)
        self.pool = VmmPool(self.driver, BudgetConfig(mode=BudgetMode.ELASTIC,
                                                      max_cache_size=budget,
                                                      execution_peak_bytes=0), 128 * MiB)
        self.copies = StepCopies(self.driver) if step_copies else None
        self.mgr = build_kv_cache_manager(self.pool, layout, enable_prefix_cache=True,
                                          host_blocks_factor=host_factor,
                                          max_tokens=max_tokens,
                                          driver=self.copies or self.driver,
                                          host_populate=False, compact=False)
        self.cache = self.mgr.cache
        self.prefix = self.mgr.prefix
        self.host = self.mgr.host
        self.groups = self.mgr.group_names
        self._scratch = {}
        self._n = 0

    def close(self) -> None:
        self.mgr.close()
        self.pool.close()
        self.driver.close()

    # -- block contents
    def _buf(self, n):
        b = self._scratch.get(n)
        if b is None:
            b = self._scratch[n] = (ctypes.c_char * n)()
        return b

    def write(self, group: str, block: int, seed: int) -> None:
        geo = self.cache.geometry[group]
        nb = geo.group.tensor_block_bytes
        for t in range(geo.num_tensors):
            pat = bytes(((seed >> (8 * (i % 16))) + i + 31 * t) & 0xFF for i in range(256))
            data = (pat * (nb // 256 + 1))[:nb]
            buf = self._buf(nb)
            ctypes.memmove(buf, data, nb)
            self.driver.copy(self.cache.block_address(group, t, block), ctypes.addressof(buf),
                             nb, CopyKind.H2D)

    def read(self, group: str, block: int) -> bytes:
        geo = self.cache.geometry[group]
        nb = geo.group.tensor_block_bytes
        out = []
        for t in range(geo.num_tensors):
            buf = (ctypes.c_char * nb)()
            self.driver.copy(ctypes.addressof(buf), self.cache.block_address(group, t, block),
                             nb, CopyKind.D2H)
            out.append(bytes(buf))
        return b"".join(out)

    # -- request lifecycle, through the manager (what the engine does)
    def start(self, tokens):
        """lookup + allocate of the whole prompt; ``None`` on "not now" (the hit dropped)."""
        rid = f"r{self._n}"
        self._n += 1
        hit = self.mgr.lookup(rid, tokens)
        t = self.mgr.allocate(rid, len(tokens) - hit.num_tokens, hit=hit)
        if t is None:
            self.mgr.drop(rid)
            return None
        req = Req(list(tokens), block_hashes(tokens, BS), t, hit.num_device_tokens // BS)
        req.rid = rid
        req.host = hit.num_host_tokens // BS
        if req.host:
            req.restore = RestoreView(self, req)
        return req

    def compute(self, req: Req) -> None:
        """Wait for a restore, write every block not hit nor restored, commit the prompt."""
        first = req.hit
        if req.restore is not None and req.restore.wait():
            first += req.restore.num_blocks
        for i in range(first, len(req.blocks[self.groups[0]])):
            seed = req.hashes[i] if i < len(req.hashes) else 12345
            for g in self.groups:
                self.write(g, req.blocks[g][i], seed)
        self.mgr.commit(req.rid, len(req.tokens), req.tokens)

    def finish(self, req: Req) -> None:
        """free (cancels a restore in flight) + step (write-through submitted)."""
        self.mgr.free(req.rid)
        self.mgr.step()

    def expected(self, group: str, h: int) -> bytes:
        geo = self.cache.geometry[group]
        nb = geo.group.tensor_block_bytes
        out = []
        for t in range(geo.num_tensors):
            pat = bytes(((h >> (8 * (i % 16))) + i + 31 * t) & 0xFF for i in range(256))
            out.append((pat * (nb // 256 + 1))[:nb])
        return b"".join(out)


def toks(*blocks, tail=1):
    out = []
    for b in blocks:
        out += [b * 100 + i for i in range(BS)]
    return out + [7] * tail
