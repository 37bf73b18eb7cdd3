"""The host KV pool: preallocated host memory for the host KV tier (HK-01, HK-06, HK-07), with its
own hash index, LRU and pins.

Sizing (HK-06): :func:`~xllm_vmm.kvcache.host_support.host_pool_size` (the one home of the
formula, re-exported here), preallocated at start, also in elastic mode. One *host block* holds
the KV of one prefix hash in every cache group and every tensor of the group, back to back in
the order the host tier lists them
(:func:`~xllm_vmm.kvcache.host_support.host_block_bytes`).

HK-07: start-up refuses a pool that does not fit in the host's available memory
(``MemAvailable``), with the numbers and the largest factor / ``max_cache_size`` that would fit.

Invariants: a host block is in exactly one of *free*, *filling* (an offload copy in flight; not
indexed), *indexed*; an indexed block is in the LRU iff it is not pinned (a restore copy reads it).
Units: bytes, host blocks.
"""

from __future__ import annotations

import ctypes
import math
import mmap
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from xllm_vmm.kvcache.hashing import BlockHash
from xllm_vmm.kvcache.host_support import HostPoolSize, host_pool_size  # noqa: F401 (HK-06 lives there)

_GiB = 1 << 30


def _gib(n: int | float) -> str:
    return f"{n / _GiB:.2f} GiB"


class HostPoolTooLarge(RuntimeError):
    """HK-07: the preallocated host KV pool does not fit in available host memory."""

    def __init__(self, need_bytes: int, available_bytes: int, factor: float,
                 device_capacity_bytes: int) -> None:
        self.need_bytes = need_bytes
        self.available_bytes = available_bytes
        self.factor = factor
        self.device_capacity_bytes = device_capacity_bytes
        max_factor = available_bytes / device_capacity_bytes if device_capacity_bytes else 0.0
        max_cache = int(available_bytes / factor) if factor > 0 else 0
        self.max_factor = max_factor
        self.max_device_capacity_bytes = max_cache
        super().__init__(
            f"HK-07: the host KV pool needs {need_bytes} bytes ({_gib(need_bytes)}: "
            f"host_blocks_factor={factor:g} x device KV capacity {device_capacity_bytes} bytes "
            f"({_gib(device_capacity_bytes)})) but only {available_bytes} bytes "
            f"({_gib(available_bytes)}) of host memory are available (MemAvailable). "
            f"Lower host_blocks_factor to at most {max_factor:.3f} (offload needs > 1), or cap "
            f"the device KV capacity with max_cache_size <= {max_cache} bytes "
            f"({_gib(max_cache)}), or free host memory.")


def available_host_memory() -> int:
    """Host memory available now in bytes: ``MemAvailable``, capped by the cgroup limit."""
    from xllm_vmm.vmm.sysmem import host_memory

    return host_memory().free


def check_host_pool_fits(size: HostPoolSize, available_bytes: int | None = None) -> None:
    """HK-07: raise :class:`HostPoolTooLarge` if ``size`` exceeds available host memory."""
    avail = available_host_memory() if available_bytes is None else available_bytes
    if size.bytes > avail:
        raise HostPoolTooLarge(size.bytes, avail, size.factor, size.device_capacity_bytes)


class HostBuffer:
    """``nbytes`` of preallocated host memory at :attr:`address`.

    Pinned (page-locked, DMA-able) memory from the driver when it offers ``alloc_host(nbytes)``
    / ``free_host(address)``; otherwise anonymous memory mapped with ``MAP_POPULATE`` so that the
    pages are committed at start (HK-06 "preallocated"), not on first use."""

    def __init__(self, nbytes: int, driver: Any = None, *, populate: bool = True) -> None:
        self.nbytes = nbytes
        self._driver = driver
        self._mm: mmap.mmap | None = None
        alloc = getattr(driver, "alloc_host", None)
        if nbytes == 0:
            self.address = 0
            self.pinned = False
        elif alloc is not None:
            self.address = int(alloc(nbytes))
            self.pinned = True
        else:
            flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20)
            if populate:
                flags |= getattr(mmap, "MAP_POPULATE", 0)
            self._mm = mmap.mmap(-1, nbytes, flags=flags)
            self._cbuf = (ctypes.c_char * nbytes).from_buffer(self._mm)
            self.address = ctypes.addressof(self._cbuf)
            self.pinned = False

    def view(self, offset: int, nbytes: int) -> bytes:
        """A copy of ``nbytes`` at ``offset`` (tests, tools)."""
        if offset < 0 or offset + nbytes > self.nbytes:
            raise IndexError(f"host buffer range [{offset}, {offset + nbytes}) outside "
                             f"[0, {self.nbytes})")
        return ctypes.string_at(self.address + offset, nbytes)

    def close(self) -> None:
        if self._mm is not None:
            del self._cbuf
            self._mm.close()
            self._mm = None
        elif self.address and self._driver is not None:
            self._driver.free_host(self.address)
        self.address = 0


class HostPool:
    """Preallocated host blocks with a hash index, an LRU of unpinned indexed blocks and pins.

    Block ``i`` lives at ``buffer.address + i * block_bytes``."""

    def __init__(self, size: HostPoolSize, driver: Any = None, *, populate: bool = True) -> None:
        self.size = size
        self.block_bytes = size.block_bytes
        self.capacity = size.blocks
        self.buffer = HostBuffer(size.bytes, driver, populate=populate)
        self._free: list[int] = list(range(size.blocks - 1, -1, -1))  # pop() gives block 0 first
        self._index: dict[BlockHash, int] = {}
        self._hash: dict[int, BlockHash] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._pins: dict[int, int] = {}
        self._filling: set[int] = set()
        self.evictions = 0

    def address(self, block: int) -> int:
        return self.buffer.address + block * self.block_bytes

    # queries
    def lookup(self, h: BlockHash) -> int | None:
        return self._index.get(h)

    def __contains__(self, h: BlockHash) -> bool:
        return h in self._index

    @property
    def used(self) -> int:
        return self.capacity - len(self._free)

    @property
    def indexed(self) -> int:
        return len(self._index)

    def lru_order(self) -> list[int]:
        return list(self._lru)

    def pin_count(self, block: int) -> int:
        return self._pins.get(block, 0)

    def hash_of(self, block: int) -> BlockHash | None:
        return self._hash.get(block)

    # filling (offload)
    def reserve(self) -> int | None:
        """A block to offload into: a free one, else the LRU victim (its hash is forgotten);
        None when every block is pinned or filling. The block is *filling* until
        :meth:`commit` or :meth:`abort`."""
        if self._free:
            b = self._free.pop()
        elif self._lru:
            b, _ = self._lru.popitem(last=False)
            del self._index[self._hash.pop(b)]
            self.evictions += 1
        else:
            return None
        self._filling.add(b)
        return b

    def commit(self, block: int, h: BlockHash) -> bool:
        """The offload copy into ``block`` finished: index it under ``h`` (most recent). False
        (block freed) if ``h`` got indexed meanwhile by another copy."""
        self._filling.remove(block)
        if h in self._index:
            self._free.append(block)
            return False
        self._index[h] = block
        self._hash[block] = h
        if not self._pins.get(block):
            self._lru[block] = None
        return True

    def abort(self, block: int) -> None:
        """The offload copy into ``block`` failed: back to the free list."""
        self._filling.remove(block)
        self._free.append(block)

    # restore
    def touch(self, block: int) -> None:
        """A hit: make ``block`` the most recently used."""
        if block in self._lru:
            self._lru.move_to_end(block)

    def pin(self, block: int) -> None:
        self._pins[block] = self._pins.get(block, 0) + 1
        self._lru.pop(block, None)

    def unpin(self, block: int) -> None:
        c = self._pins.get(block, 0)
        if c <= 0:
            raise RuntimeError(f"host block {block} is not pinned")
        if c == 1:
            del self._pins[block]
            if block in self._hash:
                self._lru[block] = None
        else:
            self._pins[block] = c - 1

    def reset(self) -> int:
        """Forget every unpinned indexed block (operator reset); returns how many."""
        n = 0
        for b in list(self._lru):
            del self._lru[b]
            del self._index[self._hash.pop(b)]
            self._free.append(b)
            n += 1
        return n

    def close(self) -> None:
        self.buffer.close()
