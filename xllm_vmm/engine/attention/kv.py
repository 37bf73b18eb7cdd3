"""K/V tensors of every attention layer, viewing the virtual KV cache's arena in place.

Geometry (see :mod:`xllm_vmm.kvcache.cache`): a cache group of ``S`` slots has, per tensor
(``layer{i}.k``, ``layer{i}.v``), ``S`` consecutive pages of ``P`` bytes; block ``b`` lives in
slot ``b // Bps`` at byte ``(b % Bps) * tensor_block_bytes`` of that tensor's page, where
``Bps = P // tensor_block_bytes`` (a page may end with padding when ``tensor_block_bytes`` does
not divide ``P``). Each tensor is therefore viewed, without a copy, as

- ``slots``:  ``(S, Bps * block_size, H, D)`` with strides ``(P / elem, H*D, D, 1)`` — token
  ``t`` of block ``b`` is ``[b // Bps, (b % Bps) * block_size + t]`` (writes of new K/V);
- ``blocks``: ``(S, Bps, block_size, H, D)`` — block ``b`` is ``[b // Bps, b % Bps]``;
- ``rows``: ``(S * P / (g * elem), g)`` elements, ``g = gcd(P / elem, block elements)``: block
  ``b`` is the ``rows_per_block`` rows from ``(b // Bps) * rows_per_page + (b % Bps) *
  rows_per_block`` — the form a gather uses (one ``index_select`` into a reused buffer, which
  is several times faster than advanced indexing into a fresh tensor), padding or not.

A flat slot of the step description (``block_id * block_size + pos % block_size``) maps to
``(flat // (Bps * block_size), flat % (Bps * block_size))`` of ``slots``.

Invariant 1 (docs/architecture.md) is the caller's: only blocks the KV cache manager handed out (their
pages mapped) are read or written; the backends index nothing else (padding entries of a block
table are replaced by a block of the same sequence before any gather).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

    from xllm_vmm.kvcache import VirtualKVCache


class KVLayoutMismatch(ValueError):
    """The cache layout does not hold what the model's attention layers need (names the
    group / tensor / width and what to change)."""


@dataclass
class PagedKV:
    """One attention layer's K and V over its cache group (views, never copies)."""

    k_slots: Tensor
    v_slots: Tensor
    k_blocks: Tensor
    v_blocks: Tensor
    k_rows: Tensor
    v_rows: Tensor


@dataclass(frozen=True)
class KVGeometry:
    """What the backends need to turn block ids and flat slots into view indices."""

    group: str
    block_size: int
    blocks_per_slot: int
    num_blocks: int
    row_elems: int = 1
    rows_per_block: int = 1
    rows_per_page: int = 1

    @property
    def tokens_per_slot(self) -> int:
        return self.blocks_per_slot * self.block_size

    def block_rows(self, blocks):
        """``(n * rows_per_block,)`` int64 row indices of ``blocks`` (an int64 tensor) in a
        ``rows`` view, block after block."""
        import torch

        start = (blocks // self.blocks_per_slot) * self.rows_per_page + \
            (blocks % self.blocks_per_slot) * self.rows_per_block
        if self.rows_per_block == 1:
            return start.reshape(-1)
        return (start.reshape(-1, 1) + torch.arange(self.rows_per_block)).reshape(-1)


def kv_torch_dtype(bytes_per_elem: int, compute_dtype):
    """The torch dtype of cached K/V: the compute dtype when its size matches the layout's
    element size, float32 for 4 bytes, bfloat16 for 2; 1-byte KV (int8 / fp8) is refused."""
    import torch

    if torch.empty((), dtype=compute_dtype).element_size() == bytes_per_elem:
        return compute_dtype
    table = {4: torch.float32, 2: torch.bfloat16}
    if bytes_per_elem not in table:
        raise KVLayoutMismatch(f"a {bytes_per_elem}-byte KV element (kv_cache_dtype int8/fp8) "
                               "is not supported by the engine yet; set --kv_cache_dtype auto")
    return table[bytes_per_elem]


class KVCacheViews:
    """Per-layer :class:`PagedKV` over the ``group`` of a :class:`VirtualKVCache`.

    ``layers[i]`` is attention layer ``i`` (tensors ``layer{i}.k`` / ``layer{i}.v`` of the
    layout); ``dtype`` is the cached element type. ``layer_ids`` (hybrid models, whose
    full-attention layers are only some of the model's) lists the layer numbers to view instead
    of ``range(num_layers)``; ``layers[j]`` is then layer ``layer_ids[j]``.
    """

    def __init__(self, cache: VirtualKVCache, *, num_layers: int, num_kv_heads: int,
                 head_dim: int, compute_dtype: Any, group: str = "attn",
                 layer_ids: Sequence[int] | None = None) -> None:
        from xllm_vmm.vmm.tensor import view

        if group not in cache.geometry:
            raise KVLayoutMismatch(
                f"the KV cache has no group {group!r} (groups: {sorted(cache.geometry)}); "
                "this model needs full-attention K/V")
        geo = cache.geometry[group]
        names = {t.name: i for i, t in enumerate(geo.group.tensors)}
        width = geo.group.tensor_bytes_per_token
        per_token = num_kv_heads * head_dim
        if width % per_token:
            raise KVLayoutMismatch(
                f"cache group {group!r} holds {width} bytes per token per tensor, not a multiple "
                f"of {num_kv_heads} KV heads x head_dim {head_dim}")
        self.dtype = kv_torch_dtype(width // per_token, compute_dtype)
        elem = width // per_token
        bs, bps, page = geo.group.block_size, geo.blocks_per_slot, geo.page_bytes
        driver = cache.pool.driver
        page_elems = page // elem
        hd = num_kv_heads * head_dim
        g = math.gcd(page_elems, bs * hd)
        self.geometry = KVGeometry(group, bs, bps, geo.num_blocks, g, bs * hd // g,
                                   page_elems // g)
        self.layers: list[PagedKV] = []
        for i in (range(num_layers) if layer_ids is None else layer_ids):
            pair = []
            for kind in "kv":
                name = f"layer{i}.{kind}"
                if name not in names:
                    raise KVLayoutMismatch(
                        f"cache group {group!r} has no tensor {name!r}: the layout was made "
                        f"for another model ({len(names) // 2} layers, this one has {num_layers})")
                t = names[name]
                flat = view(driver, geo.tensor_va(t), geo.num_slots * page, self.dtype)
                slots = flat.as_strided((geo.num_slots, bps * bs, num_kv_heads, head_dim),
                                        (page_elems, hd, head_dim, 1))
                blocks = flat.as_strided((geo.num_slots, bps, bs, num_kv_heads, head_dim),
                                         (page_elems, bs * hd, hd, head_dim, 1))
                pair.append((slots, blocks, flat.view(-1, g)))
            (ks, kb, kr), (vs, vb, vr) = pair
            self.layers.append(PagedKV(ks, vs, kb, vb, kr, vr))

    def close(self) -> None:
        """Drop the views (the reservation can be released only once no view is alive)."""
        self.layers.clear()
