"""Paged attention in plain torch: gather the blocks a sequence uses, then
``scaled_dot_product_attention`` (CPU and CUDA alike; the simplest correct backend).

Per step (:meth:`TorchSDPABackend.prepare`) the chunks are split into

- *decodes* (one query token): batched — their block tables gathered into
  ``(Bd, nb * block_size, Hkv, D)`` and one SDPA call with a key-padding mask
  ``key j < seq_len``;
- *prefill chunks*: one SDPA call each. A chunk that starts at position 0 attends over its own
  new K/V with ``is_causal`` (no gather); a chunk with an offset (chunked prefill, prefix-cache
  hit) gathers its ``ceil(seq_len / block_size)`` blocks and uses the mask
  ``key j <= start_pos + i``.

Gathers are one ``index_select`` per tensor over the layout's ``rows`` view into a buffer this
backend keeps and reuses across layers and steps (grown on demand): allocating the gathered
K/V afresh every layer cost 5x more than the copy itself (page faults of new memory).

Padding entries of a block table (beyond a sequence's blocks) are replaced by the sequence's
first block before the gather, so no block outside the sequence — possibly unmapped — is read.
Grouped-query attention uses SDPA's ``enable_gqa`` (no repeat of K/V).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from xllm_vmm.engine.attention.base import AttentionBackend

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

    from xllm_vmm.engine.attention.kv import PagedKV
    from xllm_vmm.engine.step import StepInput


@dataclass
class PrefillSeq:
    """One prefill chunk: query rows ``[q0, q1)``; ``rows`` indexes the ``nb`` blocks of
    ``[0, seq_len)`` in the ``rows`` views when ``start > 0``; ``mask`` (n, seq_len) bool,
    True = attend."""

    q0: int
    q1: int
    start: int
    seq_len: int
    nb: int = 0
    rows: Any = None
    mask: Any = None


@dataclass
class SDPAMetadata:
    write_page: Any  # (T,) int64: slot (page) index of each new token's K/V
    write_off: Any  # (T,) int64: token offset within the slot
    decode_rows: Any = None  # (Bd,) int64 rows of the token axis, or None when Bd == 0
    decode_all: bool = False  # every token is a decode (rows == arange(T))
    decode_nb: int = 0  # blocks per decode row (the longest decode's)
    decode_block_rows: Any = None  # (Bd * nb * rows_per_block,) rows of the `rows` views
    decode_mask: Any = None  # (Bd, 1, 1, nb * block_size) bool
    prefills: list[PrefillSeq] = field(default_factory=list)
    decode_keys: int = 0  # Bd * nb * block_size (workspace sizing)


class TorchSDPABackend(AttentionBackend):
    name = "torch"

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._buffers: dict[str, Any] = {}

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
        if decodes:
            lens = torch.tensor([seq_lens[i] for i in decodes], dtype=torch.int64)
            nb = -(-int(lens.max()) // bs)
            table = tables[decodes, :nb]
            used = -(-lens // bs)
            table = torch.where(torch.arange(nb)[None, :] < used[:, None], table, table[:, :1])
            meta.decode_nb = nb
            meta.decode_block_rows = geo.block_rows(table).to(dev)
            meta.decode_mask = (torch.arange(nb * bs)[None, :] < lens[:, None])[:, None, None, :].to(dev)
            meta.decode_all = len(decodes) == step.num_tokens
            meta.decode_rows = torch.tensor([qsl[i] for i in decodes], dtype=torch.int64).to(dev)
            meta.decode_keys = len(decodes) * nb * bs
        for i in range(step.num_seqs):
            q0, q1 = qsl[i], qsl[i + 1]
            if q1 - q0 == 1:
                continue
            seq_len = seq_lens[i]
            start = seq_len - (q1 - q0)
            p = PrefillSeq(q0, q1, start, seq_len)
            if start > 0:
                nb = -(-seq_len // bs)
                p.nb, p.rows = nb, geo.block_rows(tables[i, :nb]).to(dev)
                rows = torch.arange(start, seq_len)[:, None]
                p.mask = (torch.arange(seq_len)[None, :] <= rows).to(dev)
            meta.prefills.append(p)
        return meta

    def write_kv(self, kv: PagedKV, k: Tensor, v: Tensor, meta: SDPAMetadata) -> None:
        idx = (meta.write_page, meta.write_off)
        kv.k_slots.index_put_(idx, k.to(kv.k_slots.dtype))
        kv.v_slots.index_put_(idx, v.to(kv.v_slots.dtype))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, kv: PagedKV, meta: SDPAMetadata) -> Tensor:
        import torch
        import torch.nn.functional as F

        hkv, d, bs = self.num_kv_heads, self.head_dim, self.geometry.block_size
        if meta.decode_all and not meta.prefills:
            return self._decode(q, kv, meta)
        out = torch.empty_like(q)
        if meta.decode_rows is not None:
            out[meta.decode_rows] = self._decode(q[meta.decode_rows], kv, meta)
        for p in meta.prefills:
            qp = q[p.q0:p.q1].transpose(0, 1).unsqueeze(0)  # (1, H, n, D)
            if p.start == 0:
                kp = k[p.q0:p.q1].transpose(0, 1).unsqueeze(0)
                vp = v[p.q0:p.q1].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qp, kp.to(q.dtype), vp.to(q.dtype),
                                                   is_causal=True, scale=self.scale,
                                                   enable_gqa=True)
            else:
                kp, vp = self._gather(kv, p.rows, p.nb)
                kp, vp = kp[0, :p.seq_len], vp[0, :p.seq_len]
                o = F.scaled_dot_product_attention(
                    qp, kp.transpose(0, 1).unsqueeze(0).to(q.dtype),
                    vp.transpose(0, 1).unsqueeze(0).to(q.dtype), attn_mask=p.mask,
                    scale=self.scale, enable_gqa=True)
            out[p.q0:p.q1] = o[0].transpose(0, 1)
        return out

    def _decode(self, qd: Tensor, kv: PagedKV, meta: SDPAMetadata) -> Tensor:
        import torch.nn.functional as F

        kd, vd = self._gather(kv, meta.decode_block_rows, meta.decode_nb)
        o = F.scaled_dot_product_attention(
            qd.unsqueeze(2), kd.transpose(1, 2).to(qd.dtype), vd.transpose(1, 2).to(qd.dtype),
            attn_mask=meta.decode_mask, scale=self.scale, enable_gqa=True)
        return o.squeeze(2)

    def _gather(self, kv: PagedKV, rows: Tensor, nb: int) -> tuple[Tensor, Tensor]:
        """K and V of ``rows`` (whole blocks, ``nb`` per sequence) as
        ``(n_seqs, nb * block_size, Hkv, D)`` views of the reused buffers."""
        import torch

        g = self.geometry.row_elems
        n = rows.numel()
        out = []
        for name, src in (("k", kv.k_rows), ("v", kv.v_rows)):
            buf = self._buffers.get(name)
            if buf is None or buf.numel() < n * g or buf.dtype != src.dtype:
                buf = torch.empty(max(n * g, 2 * (buf.numel() if buf is not None else 0)),
                                  dtype=src.dtype, device=src.device)
                self._buffers[name] = buf
            dst = buf[:n * g].view(n, g)
            torch.index_select(src, 0, rows, out=dst)
            out.append(dst.view(-1, nb * self.geometry.block_size, self.num_kv_heads,
                                self.head_dim))
        return out[0], out[1]

    def workspace_bytes(self, meta: SDPAMetadata, elem: int) -> int:
        """Gathered K and V plus float32 scores of the largest single call of the layer."""
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        peak = meta.decode_keys * (2 * hkv * d * elem + h * 4)
        for p in meta.prefills:
            n = p.q1 - p.q0
            gathered = 2 * p.seq_len * hkv * d * elem if p.start else 0
            peak = max(peak, gathered + h * n * p.seq_len * 4)
        return peak
