"""Multi-head latent attention (MLA) over the ``"mla"`` cache group: one latent vector per token
per layer, viewed in place in the virtual KV cache's arena.

Cache (see :mod:`xllm_vmm.models.layout`): tensor ``layer{i}.latent`` of group ``"mla"`` holds,
per token, ``kv_lora_rank + qk_rope_head_dim`` elements — the normed compressed KV ``c`` (first
``kv_lora_rank``) followed by the rotated shared rope key ``k_rope`` — replicated on every
worker (MLA has no KV heads to split). Geometry as :mod:`.kv` describes it for K/V tensors:
``slots`` ``(S, Bps * block_size, L)`` for writes, ``blocks`` ``(S, Bps, block_size, L)``, and
``rows`` (``g``-element rows, ``g = gcd(page elements, block elements)``) for gathers (one
``index_select`` into a reused buffer), ``L`` = latent elements.

Attention is computed in the *absorbed* form (DeepSeek-V2 §2.1.2): the layer folds the
key up-projection into the query (``q_lat = W_uk^T q_nope``), so scores are
``[q_lat, q_rope] · [c, k_rope]`` — the cached latent is the key, its first ``kv_lora_rank``
elements the value — and the layer applies the value up-projection ``W_uv`` to the output.
This equals transformers' expanded form (``k = [W_uk c, k_rope]``, ``v = W_uv c``) exactly in
real arithmetic; fp32 results agree to rounding. Shapes: ``q`` ``(T, H, L)``, new ``latent``
``(T, L)``, output ``(T, H, kv_lora_rank)``.

Which rows see which keys (causal with the chunk offset, batched decodes, prefill chunks with
an offset gathering their blocks, padding entries of a block table never read) is exactly
:class:`~.torch_sdpa.TorchSDPABackend`'s per-step metadata, reused here (one home for it).

Batched multi-row chunks (:class:`ChunkBatch`): chunks with an offset and the same number of
query rows ``n`` (``2 <= n <= MAX_BATCHED_CHUNK_ROWS``; speculative decoding's verify chunks of
``1 + k`` rows, and the MTP draft's catch-up chunks) are gathered together and attended in one
SDPA call per bucket (at least two chunks; sorted by length, cut like the decodes'
buckets), with the additive mask ``key j <= start_b + i`` (causal within the chunk, every key
of the chunk's past, padding keys never attended). Before, each such chunk was one gather and
one call per layer: a verify step of ``B`` requests made ``B`` calls where the plain decode step
it replaces makes one. ``batch_chunks=False`` keeps one call per chunk (the reference the
tests compare with).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from xllm_vmm.engine.attention.kv import KVGeometry, KVLayoutMismatch, kv_torch_dtype
from xllm_vmm.engine.attention.torch_sdpa import (DECODE_BUCKET_MIN, MAX_DECODE_BUCKETS,
                                                  SDPAMetadata, TorchSDPABackend,
                                                  chunk_mask)

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

    from xllm_vmm.engine.step import StepInput
    from xllm_vmm.kvcache import VirtualKVCache

MLA_GROUP = "mla"

MAX_BATCHED_CHUNK_ROWS = 16
"""Most query rows of a chunk the batched multi-row path takes (longer chunks are prefills:
one call each, no padding across them)."""
MIN_BATCHED_CHUNKS = 2
"""Fewest chunks of one row count batched together (one alone is one call either way)."""


@dataclass
class ChunkBatch:
    """Chunks of ``n`` query rows each, with an offset, attended in one call: ``q0s`` (B,) the
    first query row of each chunk, ``rows`` (B * n,) int64 their query rows chunk by chunk,
    ``nb`` blocks per chunk (the longest's), ``block_rows`` the gather rows of the ``(B, nb)``
    table (a shorter chunk's padding entries: its first block, never attended), ``seq_lens``
    (B,) int64 keys per chunk (``start + n``); the additive mask ``(B, 1, n, nb *
    block_size)``, 0 where ``key j <= seq_len - n + i`` and -inf elsewhere, is built once per
    step and dtype (:meth:`mask`)."""

    q0s: list[int]
    n: int
    rows: Any
    nb: int
    block_rows: Any
    seq_lens: Any
    masks: dict = field(default_factory=dict)

    def mask(self, block_size: int, dtype: Any) -> Any:
        m = self.masks.get(dtype)
        if m is None:
            m = self.masks[dtype] = chunk_mask(self.seq_lens, self.n, self.nb * block_size, dtype)
        return m


@dataclass
class MLAMetadata(SDPAMetadata):
    """The K/V backend's per-step metadata plus the batched multi-row chunks
    (:class:`ChunkBatch`; their chunks are skipped by the per-chunk loop)."""

    chunk_batches: list[ChunkBatch] = field(default_factory=list)
    batched_q0: frozenset = frozenset()


@dataclass
class ChunkRows:
    """One chunk of a step: query rows ``[q0, q1)`` at positions ``start ..``, and the gather
    rows of its sequence's ``nb`` blocks covering ``[0, seq_len)``."""

    q0: int
    q1: int
    start: int
    seq_len: int
    nb: int
    rows: Any


@dataclass
class PagedLatent:
    """One MLA layer's latent cache (views of the arena, never copies)."""

    slots: Tensor  # (S, Bps * block_size, L)
    blocks: Tensor  # (S, Bps, block_size, L)
    rows: Tensor  # (S * page_elems / g, g): the gather form (KVGeometry.block_rows)


class LatentCacheViews:
    """Per-layer :class:`PagedLatent` over the ``group`` of a :class:`VirtualKVCache`
    (``layers[i]`` = tensor ``layer{i}.latent``; ``dtype`` = the cached element type).

    Same surface as :class:`~.kv.KVCacheViews` (``layers``, ``geometry``, ``dtype``, ``close``)
    so the model runner treats both alike."""

    def __init__(self, cache: VirtualKVCache, *, num_layers: int, latent_dim: int,
                 compute_dtype: Any, group: str = MLA_GROUP, prefix: str = "layer",
                 suffix: str = "latent") -> None:
        from xllm_vmm.vmm.tensor import view

        if group not in cache.geometry:
            raise KVLayoutMismatch(
                f"the KV cache has no group {group!r} (groups: {sorted(cache.geometry)}); "
                "an MLA model needs the latent cache layout (kv_lora_rank in config.json)")
        geo = cache.geometry[group]
        names = {t.name: i for i, t in enumerate(geo.group.tensors)}
        width = geo.group.tensor_bytes_per_token
        if width % latent_dim:
            raise KVLayoutMismatch(
                f"cache group {group!r} holds {width} bytes per token per tensor, not a multiple "
                f"of the latent width kv_lora_rank + qk_rope_head_dim = {latent_dim}")
        elem = width // latent_dim
        self.dtype = kv_torch_dtype(elem, compute_dtype)
        bs, bps, page = geo.group.block_size, geo.blocks_per_slot, geo.page_bytes
        page_elems = page // elem
        g = math.gcd(page_elems, bs * latent_dim)
        self.geometry = KVGeometry(group, bs, bps, geo.num_blocks, g, bs * latent_dim // g,
                                   page_elems // g)
        driver = cache.pool.driver
        self.layers: list[PagedLatent] = []
        for i in range(num_layers):
            name = f"{prefix}{i}.{suffix}"
            if name not in names:
                raise KVLayoutMismatch(
                    f"cache group {group!r} has no tensor {name!r}: the layout was made for "
                    f"another model ({len(names)} latent tensors, this one needs {num_layers})")
            flat = view(driver, geo.tensor_va(names[name]), geo.num_slots * page, self.dtype)
            slots = flat.as_strided((geo.num_slots, bps * bs, latent_dim),
                                    (page_elems, latent_dim, 1))
            blocks = flat.as_strided((geo.num_slots, bps, bs, latent_dim),
                                     (page_elems, bs * latent_dim, latent_dim, 1))
            self.layers.append(PagedLatent(slots, blocks, flat.view(-1, g)))

    def close(self) -> None:
        """Drop the views (the reservation can be released only once no view is alive)."""
        self.layers.clear()


class MLATorchBackend:
    """Absorbed MLA over :class:`PagedLatent` views in plain torch (CPU and CUDA).

    ``value_dim`` = ``kv_lora_rank`` (the value is the latent's first ``value_dim`` elements);
    ``scale`` is the softmax scale the model states (``qk_head_dim ** -0.5`` times the YaRN
    mscale² when the model uses it). ``batch_chunks``: multi-row chunks with an offset of equal
    row counts in one call per bucket (module docstring; the default), else one call each."""

    name = "mla-torch"

    def __init__(self, geometry: KVGeometry, *, num_heads: int, latent_dim: int, value_dim: int,
                 scale: float, device: Any, batch_chunks: bool = True) -> None:
        self.geometry = geometry
        self.batch_chunks = batch_chunks
        self.num_heads = num_heads
        self.latent_dim = latent_dim
        self.value_dim = value_dim
        self.scale = scale
        self.device = device
        self._index = TorchSDPABackend(geometry, num_heads=num_heads, num_kv_heads=1,
                                       head_dim=latent_dim, device=device)
        self._buffer: Tensor | None = None

    def prepare(self, step: StepInput) -> MLAMetadata:
        """Per-step row / block indices (the K/V backend's) and the batched multi-row chunks."""
        base = self._index.prepare(step)
        meta = MLAMetadata(**{f.name: getattr(base, f.name) for f in fields(SDPAMetadata)})
        if self.batch_chunks:
            meta.chunk_batches = self._chunk_batches(step, meta)
            meta.batched_q0 = frozenset(q0 for b in meta.chunk_batches for q0 in b.q0s)
        return meta

    def _chunk_batches(self, step: StepInput, meta: SDPAMetadata) -> list[ChunkBatch]:
        """Chunks with an offset grouped by row count ``n`` (``2 <= n <=
        MAX_BATCHED_CHUNK_ROWS``, at least ``MIN_BATCHED_CHUNKS`` of them), each group sorted by
        length and cut into up to ``MAX_DECODE_BUCKETS`` buckets of at least
        ``DECODE_BUCKET_MIN`` chunks (as the decodes are)."""
        import torch

        geo, bs, dev = self.geometry, self.geometry.block_size, self.device
        by_n: dict[int, list[Any]] = {}
        for p in meta.prefills:
            n = p.q1 - p.q0
            if p.start > 0 and n <= MAX_BATCHED_CHUNK_ROWS:
                by_n.setdefault(n, []).append(p)
        if not any(len(v) >= MIN_BATCHED_CHUNKS for v in by_n.values()):
            return []
        qsl = step.query_start_loc.tolist()
        chunk_of = {q0: i for i, q0 in enumerate(qsl[:-1])}
        tables = step.block_tables[geo.group].to(torch.int64)
        out = []
        for n, ps in sorted(by_n.items()):
            if len(ps) < MIN_BATCHED_CHUNKS:
                continue
            ps = sorted(ps, key=lambda p: p.seq_len)
            nbk = max(1, min(MAX_DECODE_BUCKETS, len(ps) // DECODE_BUCKET_MIN))
            for j in range(nbk):
                part = ps[j * len(ps) // nbk:(j + 1) * len(ps) // nbk]
                lens = torch.tensor([p.seq_len for p in part], dtype=torch.int64)
                nb = -(-int(lens.max()) // bs)
                table = tables[[chunk_of[p.q0] for p in part], :nb]
                used = -(-lens // bs)
                table = torch.where(torch.arange(nb)[None, :] < used[:, None], table,
                                    table[:, :1])
                rows = torch.cat([torch.arange(p.q0, p.q1) for p in part])
                out.append(ChunkBatch([p.q0 for p in part], n, rows.to(dev), nb,
                                      geo.block_rows(table).to(dev), lens.to(dev)))
        return out

    def write(self, kv: PagedLatent, latent: Tensor, meta: SDPAMetadata) -> None:
        """Store the step's new latents ``(T, L)`` into their slots (in place, in the arena)."""
        kv.slots.index_put_((meta.write_page, meta.write_off), latent.to(kv.slots.dtype))

    def _gather(self, kv: PagedLatent, rows: Tensor, nb: int) -> Tensor:
        """Latents of ``rows`` (whole blocks, ``nb`` per sequence) as ``(n_seqs, nb *
        block_size, L)``, a view of a buffer reused across layers and steps (grown on demand)."""
        import torch

        g = self.geometry.row_elems
        n = rows.numel()
        buf = self._buffer
        if buf is None or buf.numel() < n * g or buf.dtype != kv.rows.dtype:
            size = max(n * g, 2 * (buf.numel() if buf is not None else 0))
            buf = self._buffer = torch.empty(size, dtype=kv.rows.dtype, device=kv.rows.device)
        dst = buf[:n * g].view(n, g)
        torch.index_select(kv.rows, 0, rows, out=dst)
        return dst.view(-1, nb * self.geometry.block_size, self.latent_dim)

    def _sdpa(self, q: Tensor, keys: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
        """``q`` (B, H, n, L), ``keys`` (B, N, L) -> (B, H, n, value_dim)."""
        import torch.nn.functional as F

        k = keys.unsqueeze(1).to(q.dtype)
        v = k[..., :self.value_dim]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              scale=self.scale, enable_gqa=True)

    def attend(self, q: Tensor, latent: Tensor, kv: PagedLatent, meta: SDPAMetadata) -> Tensor:
        """Output ``(T, H, value_dim)`` in the latent space; ``latent`` are the step's own new
        latents (already written by :meth:`write`), used for chunks starting at position 0."""
        out = q.new_empty((q.shape[0], self.num_heads, self.value_dim))
        if meta.decode_rows is not None:
            keys = self._gather(kv, meta.decode_block_rows, meta.decode_nb)
            o = self._sdpa(q[meta.decode_rows].unsqueeze(2), keys, meta.decode_mask, False)
            if meta.decode_all and not meta.prefills:
                return o.squeeze(2)
            out[meta.decode_rows] = o.squeeze(2)
        batches = getattr(meta, "chunk_batches", ())
        for b in batches:
            keys = self._gather(kv, b.block_rows, b.nb)  # (B, nb * block_size, L)
            m = len(b.q0s)
            qb = q[b.rows].view(m, b.n, self.num_heads, -1).transpose(1, 2)  # (B, H, n, L)
            o = self._sdpa(qb, keys, b.mask(self.geometry.block_size, q.dtype), False)
            out[b.rows] = o.transpose(1, 2).reshape(m * b.n, self.num_heads, self.value_dim)
        skip = meta.batched_q0 if batches else frozenset()
        for p in meta.prefills:
            if p.q0 in skip:
                continue
            qp = q[p.q0:p.q1].transpose(0, 1).unsqueeze(0)  # (1, H, n, L)
            if p.start == 0:
                o = self._sdpa(qp, latent[p.q0:p.q1].unsqueeze(0), None, True)
            else:
                keys = self._gather(kv, p.rows, p.nb)[:, :p.seq_len]
                o = self._sdpa(qp, keys, p.mask, False)
            out[p.q0:p.q1] = o[0].transpose(0, 1)
        return out

    def chunk_rows(self, step: StepInput) -> list[ChunkRows]:
        """Per chunk: its query rows and the gather rows of the blocks of ``[0, seq_len)``."""
        import torch

        geo, bs = self.geometry, self.geometry.block_size
        qsl = step.query_start_loc.tolist()
        lens = step.seq_lens.tolist()
        tables = step.block_tables[geo.group].to(torch.int64)
        out = []
        for i in range(step.num_seqs):
            nb = -(-lens[i] // bs)
            out.append(ChunkRows(qsl[i], qsl[i + 1], lens[i] - (qsl[i + 1] - qsl[i]), lens[i], nb,
                                 geo.block_rows(tables[i, :nb]).to(self.device)))
        return out

    def keys(self, kv: PagedLatent, c: ChunkRows) -> Tensor:
        """``(seq_len, L)`` cached vectors of one chunk's sequence (a view of the buffer)."""
        return self._gather(kv, c.rows, c.nb)[0, :c.seq_len]

    def attend_masked(self, q: Tensor, kv: PagedLatent, chunks: list[ChunkRows],
                      masks: list[Tensor]) -> Tensor:
        """Like :meth:`attend`, each chunk over its gathered latents with its own
        ``(n, seq_len)`` boolean mask (True = attend; sparse attention's selection)."""
        out = q.new_empty((q.shape[0], self.num_heads, self.value_dim))
        for c, m in zip(chunks, masks):
            qp = q[c.q0:c.q1].transpose(0, 1).unsqueeze(0)
            o = self._sdpa(qp, self.keys(kv, c).unsqueeze(0), m, False)
            out[c.q0:c.q1] = o[0].transpose(0, 1)
        return out

    def workspace_bytes(self, meta: SDPAMetadata, elem: int) -> int:
        """Gathered latents plus float32 scores of the largest single call of one layer."""
        h, L = self.num_heads, self.latent_dim
        peak = meta.decode_keys * (L * elem + h * 4)
        for b in getattr(meta, "chunk_batches", ()):
            keys = len(b.q0s) * b.nb * self.geometry.block_size
            peak = max(peak, keys * L * elem + h * b.n * keys * 4)
        for p in meta.prefills:
            n = p.q1 - p.q0
            gathered = p.seq_len * L * elem if p.start else 0
            peak = max(peak, gathered + h * n * p.seq_len * 4)
        return peak


__all__ = ["ChunkBatch", "ChunkRows", "LatentCacheViews", "MLAMetadata", "MLATorchBackend",
           "MLA_GROUP", "MAX_BATCHED_CHUNK_ROWS", "PagedLatent"]
