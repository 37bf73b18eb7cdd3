"""Paged attention on Ascend NPUs through torch_npu's fused inference attention operator.

**Written against the documented API, not run on hardware here** (no NPU; the tests skip
without one and check the call plumbing with a stand-in of the operator).

Operator: ``torch_npu.npu_fused_infer_attention_score(query, key, value, *, atten_mask,
actual_seq_lengths, actual_seq_lengths_kv, block_table, num_heads, scale,
input_layout, num_key_value_heads, sparse_mode, block_size)`` (Ascend Extension for PyTorch,
custom API reference). In its paged mode ``key``/``value`` are the whole caches shaped
``(num_blocks, block_size, Hkv * D)``, ``block_table`` is ``(B, max_blocks)`` int32 and
``actual_seq_lengths_kv`` the per-sequence KV lengths; a query of length 1 takes the
incremental (decode) branch, longer queries the prompt branch, where ``sparse_mode=3``
(right-down causal) with the operator's 2048 x 2048 upper-triangular ``atten_mask`` gives
exactly "query ``i`` of a chunk sees keys ``<= kv_len - q_len + i``" — the chunk offset of
chunked prefill and prefix hits. Argument names follow torch_npu 2.1+ (``scale``; older releases
named it ``scale_value``: the backend passes whichever the installed signature has).

The paged operator needs every block at a uniform stride, so this backend requires the cache
page to hold a whole number of blocks (no page padding: ``block_size * Hkv * D * elem`` must
divide the 2 MiB page); otherwise it refuses at construction, naming ``block_size``. New K/V
are written with ``index_copy_`` into the flat ``(num_blocks * block_size, Hkv, D)`` view.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from xllm_vmm.engine.attention.base import AttentionBackend

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

    from xllm_vmm.engine.attention.kv import PagedKV
    from xllm_vmm.engine.step import StepInput

CAUSAL_MASK_SIZE = 2048  # the operator's compressed causal mask for sparse_mode 2/3/4


@dataclass
class NpuMetadata:
    slots: Any  # (T,) int64 flat token slots
    block_tables: Any  # (B, max_blocks) int32
    q_lens: list[int]
    seq_lens: list[int]
    q_starts: list[int]
    decode_only: bool


def _operator():
    import torch_npu  # noqa: F401  (an NPU is required; the selector checks the device first)

    return torch_npu.npu_fused_infer_attention_score


class NpuPagedBackend(AttentionBackend):
    name = "npu"

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        geo = self.geometry
        if geo.rows_per_page != geo.blocks_per_slot * geo.rows_per_block:
            raise ValueError(
                f"the npu attention backend needs whole blocks per 2 MiB page; block_size "
                f"{geo.block_size} leaves padding at the end of each page (choose a power of two)")
        self._mask = None
        self._op = None
        self._scale_kw = "scale"

    def _call(self, *args: Any, **kw: Any):
        if self._op is None:
            self._op = _operator()
            try:
                params = inspect.signature(self._op).parameters
                if "scale" not in params and "scale_value" in params:
                    self._scale_kw = "scale_value"
            except (TypeError, ValueError):  # builtins without a signature: the current name
                pass
        kw[self._scale_kw] = kw.pop("scale")
        return self._op(*args, **kw)[0]

    def _causal_mask(self):
        import torch

        if self._mask is None:
            self._mask = torch.triu(torch.ones(CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE,
                                               dtype=torch.bool, device=self.device), diagonal=1)
        return self._mask

    def prepare(self, step: StepInput) -> NpuMetadata:
        g = self.geometry.group
        qsl = step.query_start_loc.tolist()
        q_lens = [qsl[i + 1] - qsl[i] for i in range(step.num_seqs)]
        return NpuMetadata(slots=step.slot_mapping[g].to(self.device),
                           block_tables=step.block_tables[g].to(self.device),
                           q_lens=q_lens, seq_lens=step.seq_lens.tolist(), q_starts=qsl[:-1],
                           decode_only=all(n == 1 for n in q_lens))

    def _flat(self, kv: PagedKV):
        geo, hd = self.geometry, self.num_kv_heads * self.head_dim
        n = kv.k_rows.shape[0] * geo.row_elems // (geo.block_size * hd)
        return (kv.k_rows.view(n, geo.block_size, hd), kv.v_rows.view(n, geo.block_size, hd))

    def write_kv(self, kv: PagedKV, k: Tensor, v: Tensor, meta: NpuMetadata) -> None:
        kc, vc = self._flat(kv)
        hd = self.num_kv_heads * self.head_dim
        kc.view(-1, hd).index_copy_(0, meta.slots, k.reshape(-1, hd).to(kc.dtype))
        vc.view(-1, hd).index_copy_(0, meta.slots, v.reshape(-1, hd).to(vc.dtype))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, kv: PagedKV, meta: NpuMetadata) -> Tensor:
        import torch

        kc, vc = self._flat(kv)
        h, d = self.num_heads, self.head_dim
        common = dict(num_heads=h, num_key_value_heads=self.num_kv_heads, scale=self.scale,
                      input_layout="BSH", block_size=self.geometry.block_size)
        if meta.decode_only:
            out = self._call(q.reshape(-1, 1, h * d).contiguous(), kc, vc,
                             block_table=meta.block_tables, actual_seq_lengths_kv=meta.seq_lens,
                             **common)
            return out.view(-1, h, d)
        out = torch.empty_like(q)
        for i, (q0, n) in enumerate(zip(meta.q_starts, meta.q_lens)):
            sparse = {} if n == 1 else dict(atten_mask=self._causal_mask(), sparse_mode=3)
            o = self._call(q[q0:q0 + n].reshape(1, n, h * d).contiguous(), kc, vc,
                           block_table=meta.block_tables[i:i + 1],
                           actual_seq_lengths=[n], actual_seq_lengths_kv=[meta.seq_lens[i]],
                           **sparse, **common)
            out[q0:q0 + n] = o.view(n, h, d)
        return out
