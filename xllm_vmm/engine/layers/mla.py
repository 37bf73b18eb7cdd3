"""Multi-head latent attention (DeepSeek-V2/V3), as transformers' ``DeepseekV3Attention``
computes it, over a latent cache (:mod:`xllm_vmm.engine.attention.mla`).

Per token ``x`` (hidden), with ``H`` heads, ``dn`` = ``qk_nope_head_dim``, ``dr`` =
``qk_rope_head_dim``, ``dv`` = ``v_head_dim``, ``r`` = ``kv_lora_rank``:

- query: ``q = q_b(norm_q(q_a(x)))`` (``q_lora_rank`` set) or ``q_proj(x)``, split per head
  into ``q_nope`` (dn) and ``q_rope`` (dr);
- latent: ``[c, k_rope] = kv_a_proj_with_mqa(x)``; ``c = norm_kv(c)`` (eps 1e-6, as
  transformers hard-codes it); ``q_rope``, ``k_rope`` rotated (RoPE over ``dr``; DeepSeek's
  interleaved pairs when ``rope_interleave``, computed as rotate-half over the de-interleaved
  vector — the same numbers transformers produces);
- cached: ``[c, k_rope]`` (``r + dr`` elements) per token;
- attention, absorbed: ``kv_b_proj`` ``(H * (dn + dv), r)`` splits into ``W_uk`` ``(H, dn, r)``
  and ``W_uv`` ``(H, dv, r)``; ``q_lat = W_uk^T q_nope``; scores ``[q_lat, q_rope] · [c, k_rope]``
  times ``scale``; ``o = W_uv (softmax · c)``; output ``o_proj(o)``.

``scale`` = ``(dn + dr) ** -0.5``, times ``mscale²`` for YaRN rope with ``mscale_all_dim``
(transformers' ``yarn_apply_mscale``); YaRN frequencies themselves are not implemented by the
shared rotary layer, so such configs are refused there with the field named.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping

from xllm_vmm.engine.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from xllm_vmm.engine.layers.norm import RMSNorm
from xllm_vmm.engine.layers.parallel import SINGLE, TensorParallel
from xllm_vmm.engine.layers.rotary import RotaryEmbedding

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

    from xllm_vmm.engine.attention.mla import MLATorchBackend, PagedLatent

LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with the default eps


def mla_softmax_scale(qk_head_dim: int, rope: Mapping[str, Any]) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale²`` when the rope is scaled with ``mscale_all_dim``
    (``mscale = 0.1 * mscale_all_dim * ln(factor) + 1`` for ``factor > 1``)."""
    scale = qk_head_dim ** -0.5
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        factor = float(rope.get("factor", 1.0))
        if factor > 1:
            m = 0.1 * float(rope["mscale_all_dim"]) * math.log(factor) + 1.0
            scale *= m * m
    return scale


class MLAttention:
    """One MLA layer over referenced weights ``{prefix}.q_a_proj.weight`` etc. (HF names)."""

    def __init__(self, get, prefix: str, *, hidden: int, num_heads: int, q_lora_rank: int | None,
                 kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, rotary: RotaryEmbedding, interleave: bool,
                 maybe=None, tp: TensorParallel = SINGLE) -> None:
        """``get(name, shape)`` returns a checkpoint tensor (raising when missing); ``maybe(name)``
        returns it or None (biases)."""
        import torch

        maybe = maybe or (lambda name: None)
        h, dn, dr, dv, r = num_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank
        self.num_heads = h // tp.world_size
        self.dn, self.dr, self.dv, self.r = dn, dr, dv, r
        dq = dn + dr
        if q_lora_rank is not None:
            self.q_a = ReplicatedLinear(get(f"{prefix}.q_a_proj.weight", (q_lora_rank, hidden)),
                                        maybe(f"{prefix}.q_a_proj.bias"))
            self.q_norm = RMSNorm(get(f"{prefix}.q_a_layernorm.weight", (q_lora_rank,)),
                                  LATENT_NORM_EPS)
            self.q_b = ColumnParallelLinear(get(f"{prefix}.q_b_proj.weight", (h * dq, q_lora_rank)),
                                            tp=tp, what="attention heads")
            self.q_proj = None
        else:
            self.q_a = self.q_norm = self.q_b = None
            self.q_proj = ColumnParallelLinear(get(f"{prefix}.q_proj.weight", (h * dq, hidden)),
                                               tp=tp, what="attention heads")
        self.kv_a = ReplicatedLinear(get(f"{prefix}.kv_a_proj_with_mqa.weight", (r + dr, hidden)),
                                     maybe(f"{prefix}.kv_a_proj_with_mqa.bias"))
        self.kv_norm = RMSNorm(get(f"{prefix}.kv_a_layernorm.weight", (r,)), LATENT_NORM_EPS)
        kv_b = get(f"{prefix}.kv_b_proj.weight", (h * (dn + dv), r))
        if tp.world_size > 1 and tp.shard_hook is None:  # full tensor: this rank's heads, a view
            start, size = tp.shard(h, "attention heads")
            kv_b = kv_b.narrow(0, start * (dn + dv), size * (dn + dv))
        per_head = kv_b.view(self.num_heads, dn + dv, r)  # a view of the referenced weight
        self.w_uk = per_head[:, :dn, :]  # (H, dn, r)
        self.w_uv = per_head[:, dn:, :]  # (H, dv, r)
        self.o_proj = RowParallelLinear(get(f"{prefix}.o_proj.weight", (hidden, h * dv)),
                                        maybe(f"{prefix}.o_proj.bias"), tp=tp,
                                        what="attention heads")
        self.rotary = rotary
        self.interleave = interleave
        self._perm = (torch.cat((torch.arange(0, dr, 2), torch.arange(1, dr, 2)))
                      if interleave else None)

    @property
    def latent_dim(self) -> int:
        return self.r + self.dr

    def _rope(self, positions: Tensor, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        if self._perm is not None:
            perm = self._perm.to(q.device)
            q, k = q[..., perm], k[..., perm]
        return self.rotary(positions, q, k)

    def __call__(self, x: Tensor, positions: Tensor, kv: PagedLatent, backend: MLATorchBackend,
                 meta: Any) -> Tensor:
        import torch

        t = x.shape[0]
        q = self.q_proj(x) if self.q_proj is not None else self.q_b(self.q_norm(self.q_a(x)))
        q = q.view(t, self.num_heads, self.dn + self.dr)
        q_nope, q_rope = q[..., :self.dn], q[..., self.dn:]
        ckv = self.kv_a(x)
        c, k_rope = self.kv_norm(ckv[:, :self.r]), ckv[:, self.r:]
        q_rope, k_rope = self._rope(positions, q_rope, k_rope.unsqueeze(1))
        latent = torch.cat((c, k_rope.squeeze(1)), dim=-1)  # (T, r + dr)
        backend.write(kv, latent, meta)
        q_lat = torch.einsum("thn,hnr->thr", q_nope, self.w_uk)
        o_lat = backend.attend(torch.cat((q_lat, q_rope), dim=-1), latent, kv, meta)
        o = torch.einsum("thr,hvr->thv", o_lat, self.w_uv)
        return self.o_proj(o.reshape(t, self.num_heads * self.dv))


class Indexer:
    """DeepSeek-V3.2's sparse-attention indexer (transformers' ``DeepseekV32Indexer``).

    Per token: index query ``q = wq_b(q_resid)`` (``index_n_heads`` heads of
    ``index_head_dim``), index key ``k = layer_norm(wk(x))`` (one per token: cached in the
    ``"index"`` group), both rotated on their first ``qk_rope_head_dim`` dims with half-split
    (not interleaved) RoPE. Query ``s`` scores key ``t <= s`` by
    ``sum_h w[s, h] * relu(q[s, h] · k[t] / sqrt(index_head_dim))`` with
    ``w = weights_proj(x) / sqrt(index_n_heads)`` (float32); attention then sees only the
    ``index_topk`` best keys (all of them while the context is shorter)."""

    def __init__(self, get, prefix: str, *, hidden: int, q_lora_rank: int, n_heads: int,
                 head_dim: int, rope_dim: int, topk: int, rotary: RotaryEmbedding) -> None:
        self.wq_b = ReplicatedLinear(get(f"{prefix}.wq_b.weight", (n_heads * head_dim, q_lora_rank)))
        self.wk = ReplicatedLinear(get(f"{prefix}.wk.weight", (head_dim, hidden)))
        self.k_norm_w = get(f"{prefix}.k_norm.weight", (head_dim,))
        self.k_norm_b = get(f"{prefix}.k_norm.bias", (head_dim,))
        self.weights_proj = ReplicatedLinear(get(f"{prefix}.weights_proj.weight", (n_heads, hidden)))
        self.n_heads, self.head_dim, self.rope_dim, self.topk = n_heads, head_dim, rope_dim, topk
        self.rotary = rotary

    def project(self, x: Tensor, q_resid: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Rotated index queries ``(T, H, D)`` and keys ``(T, D)``."""
        import torch
        import torch.nn.functional as F

        t, dr = x.shape[0], self.rope_dim
        q = self.wq_b(q_resid).view(t, self.n_heads, self.head_dim)
        k = F.layer_norm(self.wk(x), (self.head_dim,), self.k_norm_w, self.k_norm_b, 1e-6)
        k = k.unsqueeze(1)
        qr, kr = self.rotary(positions, q[..., :dr], k[..., :dr])
        return torch.cat((qr, q[..., dr:]), -1), torch.cat((kr, k[..., dr:]), -1).squeeze(1)

    def select(self, x: Tensor, q: Tensor, keys: Tensor, start: int) -> Tensor:
        """``(n, seq_len)`` bool: the keys each of the chunk's ``n`` queries (at positions
        ``start ..``) attends to — causal and among its ``index_topk`` best."""
        import torch

        n, total = q.shape[0], keys.shape[0]
        scores = torch.relu(torch.einsum("nhd,kd->nhk", q.float(), keys.float())
                            * self.head_dim ** -0.5)
        w = self.weights_proj(x).float() * self.n_heads ** -0.5
        index = torch.einsum("nh,nhk->nk", w, scores)
        causal = torch.arange(total, device=q.device)[None, :] <= \
            (start + torch.arange(n, device=q.device))[:, None]
        index = index.masked_fill(~causal, float("-inf"))
        top = index.topk(min(self.topk, total), dim=-1).indices
        return torch.zeros_like(causal).scatter_(1, top, True) & causal


class SparseMLAttention(MLAttention):
    """MLA whose keys are limited per query by an :class:`Indexer` (DeepSeek-V3.2). ``kv`` is
    ``(latent views, index-key views)``; ``backend`` has ``.mla`` and ``.index`` (both
    :class:`~xllm_vmm.engine.attention.mla.MLATorchBackend`, over the two groups)."""

    def __init__(self, *args, indexer: Indexer, **kw) -> None:
        super().__init__(*args, **kw)
        if self.q_a is None:
            raise ValueError("DeepSeek-V3.2's indexer needs q_lora_rank (its query comes from "
                             "the compressed query)")
        self.indexer = indexer

    def __call__(self, x: Tensor, positions: Tensor, kv, backend, meta) -> Tensor:
        import torch

        lat_kv, idx_kv = kv
        t = x.shape[0]
        q_resid = self.q_norm(self.q_a(x))
        q = self.q_b(q_resid).view(t, self.num_heads, self.dn + self.dr)
        q_nope, q_rope = q[..., :self.dn], q[..., self.dn:]
        ckv = self.kv_a(x)
        c, k_rope = self.kv_norm(ckv[:, :self.r]), ckv[:, self.r:]
        q_rope, k_rope = self._rope(positions, q_rope, k_rope.unsqueeze(1))
        latent = torch.cat((c, k_rope.squeeze(1)), dim=-1)
        backend.mla.write(lat_kv, latent, meta.mla)
        iq, ik = self.indexer.project(x, q_resid, positions)
        backend.index.write(idx_kv, ik, meta.index)
        masks = [self.indexer.select(x[ch.q0:ch.q1], iq[ch.q0:ch.q1],
                                     backend.index.keys(idx_kv, ch), ch.start)
                 for ch in meta.index_chunks]
        q_lat = torch.einsum("thn,hnr->thr", q_nope, self.w_uk)
        o_lat = backend.mla.attend_masked(torch.cat((q_lat, q_rope), dim=-1), lat_kv,
                                          meta.mla_chunks, masks)
        o = torch.einsum("thr,hvr->thv", o_lat, self.w_uv)
        return self.o_proj(o.reshape(t, self.num_heads * self.dv))


__all__ = ["Indexer", "LATENT_NORM_EPS", "MLAttention", "SparseMLAttention", "mla_softmax_scale"]
