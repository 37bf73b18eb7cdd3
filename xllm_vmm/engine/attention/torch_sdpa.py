"""Paged attention in plain torch: ``scaled_dot_product_attention`` per sequence over
zero-copy views of its blocks in the arena (on CUDA the decodes are batched instead; see
:class:`TorchSDPABackend`).

A sequence's blocks are mostly runs of consecutive ids in one slot (the allocator keeps a
sequence's blocks together), and a run of blocks is a contiguous token range of the ``slots``
view: ``k_slots[slot, t0:t1]`` is ``(tokens, Hkv, D)`` with no copy. Per step
(:meth:`TorchSDPABackend.prepare`) every chunk's blocks are cut into such runs; per layer each
chunk is one SDPA call over the view of its single run (or the concatenation of its runs when
its blocks are scattered — only that sequence is copied):

- a chunk starting at position 0 attends over its own new K/V with ``is_causal`` (no read);
- a decode (one query token) attends over exactly its ``seq_len`` keys (no mask);
- a chunk with an offset (chunked prefill, prefix-cache hit) uses the mask
  ``key j <= start_pos + i``.

The batched-gather indices (``decode_block_rows``, ``PrefillSeq.rows``) are derived per step
for the batched decode path (``batch_decodes``, the default) and for backends that gather (MLA
reuses them). Per layer, per-sequence SDPA over views is faster than gathering (the gather copies
every key once more than attention reads it), but whole-engine runs are faster batched, in fp32
and bf16, equal and mixed prompt lengths (docs/benchmarks.md, "Measurements behind defaults").
So decodes are batched by default on every device; ``batch_decodes=False`` keeps the
per-sequence views.

The batched decodes are sorted by length and cut into up to ``MAX_DECODE_BUCKETS`` buckets
(at least ``DECODE_BUCKET_MIN`` decodes each), each gathered and attended padded to its own
longest, with an additive float mask built once per step (SDPA converts a boolean mask into one
on every call); the buckets cut a decode step's CPU time by about a third (docs/benchmarks.md).
On CPU the decodes go instead, by default, to the native kernel
(:mod:`.native_decode`: blocks read in place, each output written straight into its row of the
step's output; cheaper than these buckets, measured in its module docstring); the buckets stay
for CUDA, for what the kernel does not take, and with ``native_decode=False`` /
``XLLM_VMM_NATIVE_DECODE=0``.

Prefill chunks (more than one query) go, where :mod:`.native_prefill` is on for the layer's
dtypes (``native_prefill`` / ``XLLM_VMM_NATIVE_PREFILL``; by default every chunk where its AMX
(bf16) or AVX-512 float32 form runs; where only its AVX-512-BF16 form runs, chunks of at most
32 queries), to
the native prefill kernel: one call per layer for all of them, K/V read in place through the
block table (the chunk's own rows after ``write_kv``), no per-chunk copies, no masks — those
are built only for the chunks SDPA still takes. Measured: docs/engine.md.

Only blocks of the step's sequences are read: runs cover ``[0, seq_len)`` exactly, and padding
entries of a block table never reach an index (the batched path replaces them by the
sequence's first block before its gather). Grouped-query attention uses SDPA's
``enable_gqa`` (no repeat of K/V).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from xllm_vmm.engine.attention.base import AttentionBackend
from xllm_vmm.engine.row_buckets import empty_rows_like


def torch_device_type(device: Any) -> str:
    import torch

    return torch.device(device).type

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

    from xllm_vmm.engine.attention.kv import PagedKV
    from xllm_vmm.engine.step import StepInput


class _LazyMask:
    """``mask``: the (n, seq_len) bool mask ``key j <= start + i`` of a chunk with an offset and
    more than one query (None otherwise), built on first use on ``device`` (a step whose
    chunks the native prefill kernel takes never builds it)."""

    @property
    def mask(self) -> Any:
        if self._mask is None and self.start and self.q1 - self.q0 > 1:
            import torch

            self._mask = (torch.arange(self.seq_len)[None, :]
                          <= torch.arange(self.start, self.seq_len)[:, None]).to(self.device)
        return self._mask


@dataclass
class PrefillSeq(_LazyMask):
    """One prefill chunk: query rows ``[q0, q1)``; ``rows`` indexes the ``nb`` blocks of
    ``[0, seq_len)`` in the ``rows`` views when ``start > 0``; ``mask`` (n, seq_len) bool,
    True = attend (built on first use)."""

    q0: int
    q1: int
    start: int
    seq_len: int
    nb: int = 0
    rows: Any = None
    device: Any = None
    _mask: Any = field(default=None, repr=False)


@dataclass
class SeqRuns(_LazyMask):
    """One chunk for the per-sequence path: query rows ``[q0, q1)`` at positions
    ``start ..``; ``runs``: ``(slot, t0, t1)`` token ranges of the ``slots`` views covering
    ``[0, seq_len)`` in order (empty for a chunk at position 0, and for a decode when decodes
    are batched: it is never read then); ``mask`` (n, seq_len) bool for a chunk with an offset
    and more than one query (None otherwise; built on first use)."""

    q0: int
    q1: int
    start: int
    seq_len: int
    runs: list[tuple[int, int, int]]
    device: Any = None
    _mask: Any = field(default=None, repr=False)


def block_runs(blocks: list[int], seq_len: int, block_size: int,
               blocks_per_slot: int) -> list[tuple[int, int, int]]:
    """Cut the blocks covering ``[0, seq_len)`` into maximal runs of consecutive ids within one
    slot, as ``(slot, first token, end token)`` of that slot's token axis."""
    nb = -(-seq_len // block_size)
    runs = []
    i = 0
    while i < nb:
        b0 = blocks[i]
        slot = b0 // blocks_per_slot
        j = i + 1
        while j < nb and blocks[j] == blocks[j - 1] + 1 and blocks[j] // blocks_per_slot == slot:
            j += 1
        t0 = (b0 % blocks_per_slot) * block_size
        runs.append((slot, t0, t0 + min((j - i) * block_size, seq_len - i * block_size)))
        i = j
    return runs


@dataclass
class SDPAMetadata:
    write_page: Any  # (T,) int64: slot (page) index of each new token's K/V
    write_off: Any  # (T,) int64: token offset within the slot
    decode_rows: Any = None  # (Bd,) int64 rows of the token axis, or None when Bd == 0
    decode_all: bool = False  # every token is a decode (rows == arange(T))
    decode_nb: int = 0  # blocks per decode row (the longest decode's)
    prefills: list[PrefillSeq] = field(default_factory=list)
    decode_keys: int = 0  # keys of the largest decode bucket, padded (workspace sizing)
    seqs: list[SeqRuns] = field(default_factory=list)  # every chunk, in chunk order
    decode_table: Any = None  # (Bd, nb) int64 block ids of the decodes (padding: first block)
    decode_lens: Any = None  # (Bd,) int64 keys per decode
    _decode_src: Any = field(default=None, repr=False)
    """What the lazy decode fields below are built from on first use (the native decode
    kernel reads only ``decode_table`` / ``decode_lens``, so a step it runs never builds
    them): ``(backend, decodes, qsl, seq_lens, tables, cpu table, cpu lens)``."""
    _decode_lazy: dict = field(default_factory=dict, repr=False)

    @property
    def decode_block_rows(self) -> Any:
        """(Bd * nb * rows_per_block,) rows of the ``rows`` views (the gather form; MLA)."""
        return self._lazy("block_rows")

    @property
    def decode_mask(self) -> Any:
        """(Bd, 1, 1, nb * block_size) bool, key ``j < seq_len`` (MLA's gathered decodes)."""
        return self._lazy("mask")

    @property
    def decode_buckets(self) -> list[DecodeBucket]:
        """The batched path's calls: decodes sorted by length, cut into buckets each padded
        to its own longest, in place of one call padded to the longest of all."""
        return self._lazy("buckets") or []

    def _lazy(self, name: str) -> Any:
        if self._decode_src is None:
            return None
        v = self._decode_lazy.get(name)
        if v is None:
            import torch

            be, decodes, qsl, seq_lens, tables, table, lens = self._decode_src
            geo, dev = be.geometry, be.device
            if name == "block_rows":
                v = geo.block_rows(table).to(dev)
            elif name == "mask":
                v = (torch.arange(self.decode_nb * geo.block_size)[None, :]
                     < lens[:, None])[:, None, None, :].to(dev)
            else:
                v = be._buckets(decodes, qsl, seq_lens, tables)
            self._decode_lazy[name] = v
        return v
    prefill_q0: Any = None  # (C,) int64 first query row of each prefill chunk (None: none)
    prefill_q1: Any = None  # (C,) int64 end row of each prefill chunk
    prefill_lens: Any = None  # (C,) int64 seq_len of each prefill chunk
    prefill_table: Any = None  # (C, nb) int64 block ids (entries beyond a chunk's are unread)
    prefill_min_n: int = 0  # fewest queries of a prefill chunk
    _native_sel: dict = field(default_factory=dict, repr=False)

    def native_prefills(self, limit: int, max_keys: int = 1 << 62,
                        any_keys_queries: int = 1 << 62) -> tuple[Any, Any, Any, Any]:
        """``(q0, q1, seq_lens, table)`` of the prefill chunks the route ``(limit, max_keys,
        any_keys_queries)`` sends to the native kernel (:func:`.native_prefill.route_takes`:
        at most ``limit`` queries, and ending within ``max_keys`` keys or of at most
        ``any_keys_queries`` queries); all of them when every chunk qualifies; cached per
        route."""
        route = (limit, max_keys, any_keys_queries)
        sel = self._native_sel.get(route)
        if sel is None:
            n = self.prefill_q1 - self.prefill_q0
            take = (n <= limit) & ((self.prefill_lens <= max_keys) | (n <= any_keys_queries))
            if bool(take.all()):
                sel = (self.prefill_q0, self.prefill_q1, self.prefill_lens, self.prefill_table)
            else:
                keep = take.nonzero().reshape(-1)
                sel = (self.prefill_q0[keep], self.prefill_q1[keep], self.prefill_lens[keep],
                       self.prefill_table[keep])
            self._native_sel[route] = sel
        return sel


@dataclass
class DecodeBucket:
    """Decodes of similar length gathered and attended in one SDPA call: ``rows`` (n,) int64
    rows of the token axis, ``block_rows`` their ``nb`` blocks' rows of the ``rows`` views,
    ``lens`` (n,) int64 keys per decode; the additive mask (0 / -inf, key ``j < lens``) is built
    once per step and dtype (``mask``)."""

    rows: Any
    nb: int
    block_rows: Any
    lens: Any
    masks: dict = field(default_factory=dict)

    def mask(self, block_size: int, dtype: Any) -> Any:
        m = self.masks.get(dtype)
        if m is None:
            m = self.masks[dtype] = chunk_mask(self.lens, 1, self.nb * block_size, dtype)
        return m


def additive_mask(keep: Any, dtype: Any) -> Any:
    """SDPA's additive form of the boolean ``keep``: 0 where True, -inf where False."""
    import torch

    m = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
    return m.masked_fill_(~keep, float("-inf"))


def chunk_mask(seq_lens: Any, n: int, num_keys: int, dtype: Any) -> Any:
    """The additive mask ``(B, 1, n, num_keys)`` of ``B`` chunks of ``n`` queries each ending
    their sequence: query ``i`` of chunk ``b`` sees keys ``j <= seq_lens[b] - n + i`` (a decode,
    ``n = 1``: ``j < seq_lens[b]``); padding keys beyond are -inf."""
    import torch

    keys = torch.arange(num_keys, device=seq_lens.device)
    last = seq_lens[:, None] - n + torch.arange(n, device=keys.device)[None, :]  # (B, n)
    return additive_mask(keys[None, None, :] <= last[:, :, None], dtype)[:, None]


DECODE_BUCKET_MIN = 16
"""Fewest decodes per bucket of the batched path (``MAX_DECODE_BUCKETS`` at most)."""
MAX_DECODE_BUCKETS = 4


def _bucket_parts(order: list) -> list[list]:
    """``order`` (decodes sorted by length) cut into the buckets' equal parts: up to
    ``MAX_DECODE_BUCKETS`` of at least ``DECODE_BUCKET_MIN`` (one home for the cut)."""
    nbk = max(1, min(MAX_DECODE_BUCKETS, len(order) // DECODE_BUCKET_MIN))
    return [order[j * len(order) // nbk:(j + 1) * len(order) // nbk] for j in range(nbk)]


class TorchSDPABackend(AttentionBackend):
    """``batch_decodes``: decodes as one batched gather + SDPA call (one call instead of one per
    sequence and layer: the default on every device, measured in the module docstring) rather
    than per-sequence views over the arena (``False``). Prefill chunks always go one call
    each. ``native_decode`` (None: on unless ``XLLM_VMM_NATIVE_DECODE=0``, where the library is
    built; only with ``batch_decodes``): the batched decodes run on the native kernel whenever
    it takes the layer's configuration (:func:`.native_decode.supports`: CPU, float32/bfloat16,
    checked once per dtype pair), the buckets otherwise."""

    name = "torch"

    def __init__(self, *args: Any, batch_decodes: bool | None = None,
                 native_decode: bool | None = None, native_prefill: bool | str | None = None,
                 **kw: Any) -> None:
        super().__init__(*args, **kw)
        from xllm_vmm.engine.attention import native_decode as nd
        from xllm_vmm.engine.attention import native_prefill as npf

        if batch_decodes is None:
            batch_decodes = True
        self.batch_decodes = batch_decodes
        if native_decode is None:
            native_decode = nd.enabled_by_env() and nd.load() is not None
        self.native_decode = bool(native_decode) and batch_decodes
        self.native_portable = nd.portable_by_env()
        self.native_amx = nd.amx_by_env()  # the decode kernel's AMX scores (ENV=avx512: off)
        if native_prefill is None:
            native_prefill = npf.mode_by_env()
        elif native_prefill is True or native_prefill is False:
            native_prefill = "on" if native_prefill else "off"
        if native_prefill not in ("off", "on", "portable", "auto"):
            raise ValueError(f"native_prefill {native_prefill!r} is not one of off, on, "
                             "portable, auto (or a bool)")
        if nd.load() is None or torch_device_type(self.device) != "cpu":
            native_prefill = "off"
        self.native_prefill = native_prefill
        """``off`` (SDPA for prefill chunks), ``on`` / ``portable`` (the native prefill kernel
        for every chunk of a configuration it takes; ``portable`` forces its portable C),
        ``auto`` (:func:`.native_prefill.default_limit`)."""
        self._prefill_ok: dict[tuple, tuple[int, int, int]] = {}
        self._native_ok: dict[tuple, bool] = {}
        self._buffers: dict[str, Any] = {}

    def _use_native(self, q: Tensor, kv: PagedKV) -> bool:
        """The native kernel runs this layer's decodes (``native_decode`` and supported)."""
        if not self.native_decode:
            return False
        key = (q.dtype, kv.k_slots.dtype, q.device.type)
        ok = self._native_ok.get(key)
        if ok is None:
            from xllm_vmm.engine.attention import native_decode as nd

            ok = self._native_ok[key] = nd.supports(q.dtype, kv.k_slots.dtype, q.device,
                                                    self.num_heads, self.num_kv_heads,
                                                    self.head_dim)
        return ok

    def _native_prefill_route(self, q: Tensor, kv: PagedKV) -> tuple[int, int, int]:
        """Which prefill chunks the native prefill kernel runs for this layer, as
        :func:`.native_prefill.default_route`'s ``(max_queries, max_keys, any_keys_queries)``
        (``(0, 0, 0)``: none; decided once per dtype pair): every chunk with ``on`` /
        ``portable``, :func:`.native_prefill.default_route` with ``auto``."""
        if self.native_prefill == "off":
            return (0, 0, 0)
        key = (q.dtype, kv.k_slots.dtype, q.device.type)
        route = self._prefill_ok.get(key)
        if route is None:
            from xllm_vmm.engine.attention import native_prefill as npf

            ok = npf.supports(q.dtype, kv.k_slots.dtype, q.device, self.num_heads,
                              self.num_kv_heads, self.head_dim)
            route = (0, 0, 0) if not ok else (npf.UNBOUNDED,) * 3 \
                if self.native_prefill != "auto" else \
                npf.default_route(q.dtype, kv.k_slots.dtype, self.head_dim)
            self._prefill_ok[key] = route
        return route

    def _native_prefill_limit(self, q: Tensor, kv: PagedKV) -> int:
        """The longest prefill chunk (queries) the native prefill kernel runs for this layer
        (0: none): :meth:`_native_prefill_route`'s first field."""
        return self._native_prefill_route(q, kv)[0]

    def prepare(self, step: StepInput) -> SDPAMetadata:
        import torch

        geo = self.geometry
        bs, tps = geo.block_size, geo.tokens_per_slot
        dev = self.device
        slots = step.slot_mapping[geo.group]
        meta = SDPAMetadata(write_page=(slots // tps).to(dev), write_off=(slots % tps).to(dev))
        qsl = step.query_start_loc.tolist()
        seq_lens = step.seq_lens.tolist()
        tables = step.block_tables[geo.group].to(torch.int64)
        decodes = [i for i in range(step.num_seqs) if qsl[i + 1] - qsl[i] == 1]
        if decodes:  # batched-gather indices of the decodes (for backends that gather, e.g. MLA)
            lens = torch.tensor([seq_lens[i] for i in decodes], dtype=torch.int64)
            nb = -(-int(lens.max()) // bs)
            table = tables[decodes, :nb]
            used = -(-lens // bs)
            table = torch.where(torch.arange(nb)[None, :] < used[:, None], table, table[:, :1])
            meta.decode_nb = nb
            meta.decode_table, meta.decode_lens = table.to(dev), lens.to(dev)
            meta.decode_all = len(decodes) == step.num_tokens
            meta.decode_rows = torch.tensor([qsl[i] for i in decodes], dtype=torch.int64).to(dev)
            meta._decode_src = (self, decodes, qsl, seq_lens, tables, table, lens)
            meta.decode_keys = max(len(part) * -(-max(part) // bs) * bs
                                   for part in _bucket_parts(sorted(seq_lens[i] for i in decodes)))
        for i in range(step.num_seqs):
            q0, q1 = qsl[i], qsl[i + 1]
            seq_len = seq_lens[i]
            start = seq_len - (q1 - q0)
            # a batched decode never reads its runs (the bucket / the kernel reads its blocks)
            runs = start and not (self.batch_decodes and q1 - q0 == 1)
            sq = SeqRuns(q0, q1, start, seq_len,
                         block_runs(tables[i, :-(-seq_len // bs)].tolist(), seq_len, bs,
                                    geo.blocks_per_slot) if runs else [], dev)
            meta.seqs.append(sq)
            if q1 - q0 == 1:
                continue
            p = PrefillSeq(q0, q1, start, seq_len, device=dev)
            p._mask = sq._mask
            if start > 0:  # gather indices (for backends that gather, e.g. MLA)
                nb = -(-seq_len // bs)
                p.nb, p.rows = nb, geo.block_rows(tables[i, :nb]).to(dev)
            meta.prefills.append(p)
        if meta.prefills and self.native_prefill != "off":
            idx = [i for i in range(step.num_seqs) if qsl[i + 1] - qsl[i] > 1]
            meta.prefill_q0 = torch.tensor([p.q0 for p in meta.prefills], dtype=torch.int64)
            meta.prefill_q1 = torch.tensor([p.q1 for p in meta.prefills], dtype=torch.int64)
            meta.prefill_lens = torch.tensor([p.seq_len for p in meta.prefills],
                                             dtype=torch.int64)
            nb = -(-max(p.seq_len for p in meta.prefills) // bs)
            meta.prefill_table = tables[idx, :nb].contiguous()
            meta.prefill_min_n = min(p.q1 - p.q0 for p in meta.prefills)
        return meta

    def _buckets(self, decodes: list[int], qsl: list[int], seq_lens: list[int],
                 tables: Tensor) -> list[DecodeBucket]:
        """Decodes sorted by length, cut into up to ``MAX_DECODE_BUCKETS`` buckets of at least
        ``DECODE_BUCKET_MIN`` (equal counts): each call reads only its own padding (measured:
        the module docstring)."""
        import torch

        geo, bs, dev = self.geometry, self.geometry.block_size, self.device
        order = sorted(decodes, key=lambda i: seq_lens[i])
        out = []
        for part in _bucket_parts(order):
            lens = torch.tensor([seq_lens[i] for i in part], dtype=torch.int64)
            nb = -(-int(lens.max()) // bs)
            table = tables[part, :nb]
            used = -(-lens // bs)
            table = torch.where(torch.arange(nb)[None, :] < used[:, None], table, table[:, :1])
            out.append(DecodeBucket(torch.tensor([qsl[i] for i in part], dtype=torch.int64).to(dev),
                                    nb, geo.block_rows(table).to(dev), lens.to(dev)))
        return out

    def write_kv(self, kv: PagedKV, k: Tensor, v: Tensor, meta: SDPAMetadata) -> None:
        """The new rows into their slots: one native copy call where the native kernel is on
        and takes the tensors (:func:`.native_decode.write_kv`; two ``index_put_`` cost
        about 0.4 ms a layer at 128 rows), else ``index_put_``."""
        if self.native_decode:
            from xllm_vmm.engine.attention.native_decode import write_kv

            dt = kv.k_slots.dtype
            if write_kv(k.to(dt), v.to(dt), kv.k_slots, kv.v_slots, meta.write_page,
                        meta.write_off):
                return
        idx = (meta.write_page, meta.write_off)
        kv.k_slots.index_put_(idx, k.to(kv.k_slots.dtype))
        kv.v_slots.index_put_(idx, v.to(kv.v_slots.dtype))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, kv: PagedKV, meta: SDPAMetadata) -> Tensor:
        import torch
        import torch.nn.functional as F

        batched = self.batch_decodes and meta.decode_rows is not None
        route = (self._native_prefill_route(q, kv) if meta.prefill_q0 is not None
                 else (0, 0, 0))
        limit = route[0]
        native_prefill = limit > 0 and meta.prefill_min_n <= limit  # maybe some chunks native
        if native_prefill:
            sel = meta.native_prefills(*route)
            native_prefill = sel[0].numel() > 0
        if native_prefill:
            q = q.contiguous()
        if batched and self._use_native(q, kv):
            from xllm_vmm.engine.attention.native_decode import paged_decode

            geo = self.geometry
            q = q.contiguous()
            out = paged_decode(q, kv.k_slots, kv.v_slots, meta.decode_table, meta.decode_lens,
                               block_size=geo.block_size, blocks_per_slot=geo.blocks_per_slot,
                               scale=self.scale, rows=None if meta.decode_all else meta.decode_rows,
                               out=empty_rows_like(q), portable=self.native_portable,
                               amx=self.native_amx)
            if meta.decode_all:
                return out
        else:
            out = empty_rows_like(q)
            if batched:
                for b in meta.decode_buckets:
                    out[b.rows] = self._decode_batched(q[b.rows], kv, b)
                if meta.decode_all:
                    return out
        kd = kv.k_slots
        if native_prefill:  # every prefill chunk in one call, K/V read in place
            from xllm_vmm.engine.attention.native_prefill import paged_prefill

            geo = self.geometry
            q0, q1, lens, table = sel
            paged_prefill(q, kd, kv.v_slots, table, q0, q1, lens, block_size=geo.block_size,
                          blocks_per_slot=geo.blocks_per_slot, scale=self.scale, out=out,
                          portable=self.native_prefill == "portable")
        else:
            limit = 0
        for sq in meta.seqs:
            if batched and sq.q1 - sq.q0 == 1:
                continue
            if 1 < sq.q1 - sq.q0 <= limit and (sq.seq_len <= route[1]
                                               or sq.q1 - sq.q0 <= route[2]):
                continue  # done by the native prefill kernel (the route's rule)
            qi = q[sq.q0:sq.q1].transpose(0, 1).unsqueeze(0)  # (1, H, n, D)
            if sq.start == 0:
                ki = k[sq.q0:sq.q1].to(q.dtype)
                vi = v[sq.q0:sq.q1].to(q.dtype)
                causal = sq.q1 - sq.q0 > 1
            else:
                runs = sq.runs
                if len(runs) == 1:
                    s_, t0, t1 = runs[0]
                    ki, vi = kd[s_, t0:t1], kv.v_slots[s_, t0:t1]
                else:
                    ki = torch.cat([kd[s_, t0:t1] for s_, t0, t1 in runs])
                    vi = torch.cat([kv.v_slots[s_, t0:t1] for s_, t0, t1 in runs])
                ki, vi = ki.to(q.dtype), vi.to(q.dtype)
                causal = False
            o = F.scaled_dot_product_attention(
                qi, ki.transpose(0, 1).unsqueeze(0), vi.transpose(0, 1).unsqueeze(0),
                attn_mask=sq.mask, is_causal=causal, scale=self.scale, enable_gqa=True)
            out[sq.q0:sq.q1] = o[0].transpose(0, 1)
        return out

    def _decode_batched(self, qd: Tensor, kv: PagedKV, bucket: DecodeBucket) -> Tensor:
        """One bucket of decodes at once: their blocks gathered (one ``index_select`` per tensor
        over the ``rows`` views, into buffers reused across layers and steps) and one SDPA call
        with the additive key-padding mask ``key j < seq_len``."""
        import torch
        import torch.nn.functional as F

        geo, hkv, d = self.geometry, self.num_kv_heads, self.head_dim
        rows, nb = bucket.block_rows, bucket.nb
        n, g = rows.numel(), geo.row_elems
        keys = []
        for name, src in (("k", kv.k_rows), ("v", kv.v_rows)):
            buf = self._buffers.get(name)
            if buf is None or buf.numel() < n * g or buf.dtype != src.dtype:
                size = max(n * g, 2 * (buf.numel() if buf is not None else 0))
                buf = self._buffers[name] = torch.empty(size, dtype=src.dtype, device=src.device)
            dst = buf[:n * g].view(n, g)
            torch.index_select(src, 0, rows, out=dst)
            keys.append(dst.view(-1, nb * geo.block_size, hkv, d).transpose(1, 2).to(qd.dtype))
        o = F.scaled_dot_product_attention(qd.unsqueeze(2), keys[0], keys[1],
                                           attn_mask=bucket.mask(geo.block_size, qd.dtype),
                                           scale=self.scale, enable_gqa=True)
        return o.squeeze(2)

    def workspace_bytes(self, meta: SDPAMetadata, elem: int) -> int:
        """Float32 scores of the largest single call of the layer, plus the copy of a chunk
        whose blocks are scattered (several runs), or the batched decodes' gather."""
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        peak = 0
        if self.batch_decodes:
            peak = meta.decode_keys * (2 * hkv * d * elem + h * 4)
        for sq in meta.seqs:
            n = sq.q1 - sq.q0
            copied = 2 * sq.seq_len * hkv * d * elem if len(sq.runs) > 1 else 0
            peak = max(peak, copied + h * n * sq.seq_len * 4)
        return peak
