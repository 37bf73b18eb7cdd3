"""Gated DeltaNet linear attention (Qwen3-Next) with its causal depthwise convolution, in plain
PyTorch (the reference paths; CPU and CUDA alike), over *resident* per-sequence state.

State per sequence and layer (what :class:`xllm_vmm.models.spec.LinearStateDims` sizes and
``plan`` reserves, HY-01):

- conv state ``(conv_dim, kernel - 1)``: the last ``kernel - 1`` inputs of the convolution,
  ``conv_dim = 2 * num_k_heads * k_dim + num_v_heads * v_dim`` (zeros before the first token);
- recurrent state ``(num_v_heads, k_dim, v_dim)``: the delta rule's fast-weight matrix per value
  head (zeros before the first token).

Delta rule, per value head and token ``t`` (transformers' ``torch_recurrent_gated_delta_rule``;
``q``, ``k`` L2-normalised (eps 1e-6), ``q`` scaled by ``k_dim ** -0.5``, key heads repeated to
the value heads): ``S = S * exp(g_t)``; ``S += k_t ⊗ (beta_t * (v_t - S^T k_t))``;
``o_t = S^T q_t``. :func:`chunk_gated_delta_rule` computes the same in blocks of ``chunk``
tokens (the WY/UT form of transformers' ``torch_chunk_gated_delta_rule``: intra-chunk by a
triangular solve, inter-chunk through the state); both take and return the state, in float32.

Causal conv (``causal_conv1d_fn`` / ``_update``): ``y_t = silu(sum_j w[:, j] * x_{t - K + 1 + j})``
over the concatenation ``[conv_state, x]``; the new conv state is its last ``K - 1`` columns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

L2_EPS = 1e-6


def l2norm(x: Tensor, eps: float = L2_EPS) -> Tensor:
    import torch

    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv1d(x: Tensor, state: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """``x`` (n, C) new inputs, ``state`` (C, K-1) previous inputs, ``weight`` (C, K) depthwise
    taps -> (``silu`` outputs (n, C), new state (C, K-1)). Computed in ``weight``'s dtype."""
    import torch
    import torch.nn.functional as F

    n = x.shape[0]
    full = torch.cat((state.to(weight.dtype), x.t().to(weight.dtype)), dim=-1)  # (C, K-1+n)
    y = F.conv1d(full.unsqueeze(0), weight.unsqueeze(1), groups=weight.shape[0])[0]  # (C, n)
    k1 = state.shape[-1]
    return F.silu(y[:, -n:]).t().to(x.dtype), full[:, full.shape[-1] - k1:]


def _prepare(q: Tensor, k: Tensor, v: Tensor, num_v_heads: int):
    """Heads-first float32 q (scaled), k (both L2-normalised, repeated to the value heads), v."""
    import torch

    rep = num_v_heads // q.shape[1]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    q, k, v = (t.transpose(0, 1).to(torch.float32) for t in (q, k, v))  # (H, n, d)
    q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v


def recurrent_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                               state: Tensor) -> tuple[Tensor, Tensor]:
    """One sequence, token by token. ``q``/``k`` (n, Hk, dk), ``v`` (n, Hv, dv), ``g``/``beta``
    (n, Hv), ``state`` (Hv, dk, dv) -> (output (n, Hv, dv) in ``v``'s dtype, new state float32)."""
    import torch

    dtype = v.dtype
    q, k, v = _prepare(q, k, v, v.shape[1])
    g, beta = g.t().to(torch.float32), beta.t().to(torch.float32)  # (H, n)
    s = state.to(torch.float32)
    out = torch.empty_like(v)
    for t in range(q.shape[1]):
        s = s * g[:, t].exp()[:, None, None]
        mem = (s * k[:, t, :, None]).sum(dim=-2)  # (H, dv)
        delta = (v[:, t] - mem) * beta[:, t, None]
        s = s + k[:, t, :, None] * delta[:, None, :]
        out[:, t] = (s * q[:, t, :, None]).sum(dim=-2)
    return out.transpose(0, 1).to(dtype), s


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                           state: Tensor, chunk: int = 64) -> tuple[Tensor, Tensor]:
    """The same as :func:`recurrent_gated_delta_rule`, ``chunk`` tokens at a time."""
    import torch
    import torch.nn.functional as F

    dtype = v.dtype
    n = q.shape[0]
    q, k, v = _prepare(q, k, v, v.shape[1])
    g, beta = g.t().to(torch.float32), beta.t().to(torch.float32)
    pad = (chunk - n % chunk) % chunk
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    h = q.shape[0]
    nc = q.shape[1] // chunk
    q, k, v = (t.reshape(h, nc, chunk, t.shape[-1]) for t in (q, k, v))
    g, beta = g.reshape(h, nc, chunk), beta.reshape(h, nc, chunk)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=-1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    lower = (k_beta @ k.transpose(-1, -2)) * decay  # unit lower-triangular system (diag ignored)
    intra = (q @ k.transpose(-1, -2)) * decay
    new_v = torch.linalg.solve_triangular(lower, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(lower, k_beta * cum.exp()[..., None], upper=False,
                                          unitriangular=True)
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    s = state.to(torch.float32)
    out = torch.empty_like(v)
    for i in range(nc):
        vi = new_v[:, i] - k_cum[:, i] @ s
        out[:, i] = q[:, i] @ s + intra[:, i] @ vi
        s = s * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ vi
    out = out.reshape(h, nc * chunk, -1)[:, :n]
    return out.transpose(0, 1).to(dtype), s


def gated_delta_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                     state: Tensor) -> tuple[Tensor, Tensor]:
    """One token of each of ``B`` sequences (batched decode): ``q``/``k`` (B, Hk, dk), ``v``
    (B, Hv, dv), ``g``/``beta`` (B, Hv), ``state`` (B, Hv, dk, dv) -> (output (B, Hv, dv) in
    ``v``'s dtype, new state float32); the recurrent rule of :func:`recurrent_gated_delta_rule`."""
    import torch

    dtype = v.dtype
    rep = v.shape[1] // q.shape[1]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    q, k, v = (t.to(torch.float32) for t in (q, k, v))
    q, k = l2norm(q), l2norm(k)
    q = q * q.shape[-1] ** -0.5
    s = state.to(torch.float32) * g.to(torch.float32).exp()[..., None, None]
    mem = (s * k[..., None]).sum(dim=-2)  # (B, H, dv)
    delta = (v - mem) * beta.to(torch.float32)[..., None]
    s = s + k[..., None] * delta[..., None, :]
    return (s * q[..., None]).sum(dim=-2).to(dtype), s


def causal_conv1d_step(x: Tensor, state: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """One new input per sequence: ``x`` (B, C), ``state`` (B, C, K-1) -> (``silu`` outputs
    (B, C), new state (B, C, K-1)); the same window sum as :func:`causal_conv1d`."""
    import torch
    import torch.nn.functional as F

    full = torch.cat((state.to(weight.dtype), x.to(weight.dtype)[..., None]), dim=-1)  # (B, C, K)
    y = (full * weight[None]).sum(-1)
    return F.silu(y).to(x.dtype), full[..., 1:]


def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                     state: Tensor) -> tuple[Tensor, Tensor]:
    """The recurrent form for short inputs (decode), the chunked form otherwise."""
    if q.shape[0] <= 4:
        return recurrent_gated_delta_rule(q, k, v, g, beta, state)
    return chunk_gated_delta_rule(q, k, v, g, beta, state)


class LinearStateCache:
    """Resident conv + recurrent state of every linear layer per sequence slot (HY-01) — plain
    device tensors outside the VMM pool — and the step's checkpoint snapshots (PC-02).

    ``conv[slot, layer]`` is ``conv_shape``, ``rec[slot, layer]`` ``rec_shape``. Nothing is
    allocated until :meth:`reserve` (the driver side decides the slot count: the running-sequence
    limit). :attr:`bytes_per_seq` equals ``ResidentState.bytes_per_seq`` of the model's layout.

    A *checkpoint* is the state of one sequence after a block boundary, every layer:
    ``(conv (layers, *conv_shape), rec (layers, *rec_shape))``, new tensors (not slots), taken
    during a step (:meth:`save`, layer by layer) and handed to the prefix cache with the block
    (:meth:`take`); a prefix hit's checkpoint is copied back into a slot by :meth:`restore`."""

    def __init__(self, num_layers: int, conv_shape: tuple[int, ...], rec_shape: tuple[int, ...],
                 *, dtype, device) -> None:
        self.num_layers, self.conv_shape, self.rec_shape = num_layers, conv_shape, rec_shape
        self.dtype, self.device = dtype, device
        self.conv = self.rec = None
        self.num_slots = 0
        self.snapshots: dict[tuple[str, int], tuple] = {}

    @property
    def bytes_per_seq(self) -> int:
        import math

        import torch

        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * (math.prod(self.conv_shape) + math.prod(self.rec_shape)) * elem

    @property
    def reserved_bytes(self) -> int:
        """Bytes of the live slots (checkpoints are owned by the prefix cache's entries)."""
        return self.num_slots * self.bytes_per_seq

    def reserve(self, num_slots: int) -> None:
        """Allocate ``num_slots`` live slots (zeros)."""
        import torch

        def make(shape):
            return torch.zeros((num_slots, self.num_layers, *shape), dtype=self.dtype,
                               device=self.device)

        self.conv, self.rec = make(self.conv_shape), make(self.rec_shape)
        self.num_slots = num_slots

    def _check(self, slot: int) -> None:
        if self.conv is None:
            raise RuntimeError("the linear-state cache has no slots: reserve() it first "
                               "(engine.linear_state.LinearStateManager does)")
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"state slot {slot} out of range (0..{self.num_slots - 1})")

    def reset(self, slot: int) -> None:
        self._check(slot)
        self.conv[slot].zero_()
        self.rec[slot].zero_()

    def restore(self, slot: int, checkpoint: tuple) -> None:
        """Every layer's state of ``checkpoint`` (see the class doc) into slot ``slot``."""
        self._check(slot)
        conv, rec = checkpoint
        if tuple(conv.shape) != tuple(self.conv[slot].shape) or \
                tuple(rec.shape) != tuple(self.rec[slot].shape):
            raise ValueError("a linear-state checkpoint of another model was handed to restore()")
        self.conv[slot].copy_(conv)
        self.rec[slot].copy_(rec)

    def save(self, slot: int, key: tuple[str, int], layer: int) -> None:
        """Layer ``layer``'s current state of ``slot`` into the snapshot ``key`` (request id,
        position), created at its first layer."""
        import torch

        self._check(slot)
        snap = self.snapshots.get(key)
        if snap is None:
            snap = self.snapshots[key] = (torch.empty_like(self.conv[slot]),
                                          torch.empty_like(self.rec[slot]))
        snap[0][layer].copy_(self.conv[slot, layer])
        snap[1][layer].copy_(self.rec[slot, layer])

    def take(self, request_id: str) -> dict[int, tuple]:
        """The snapshots of ``request_id`` taken so far, by position, removed from the cache."""
        keys = [k for k in self.snapshots if k[0] == request_id]
        return {k[1]: self.snapshots.pop(k) for k in keys}


__all__ = ["LinearStateCache", "causal_conv1d", "causal_conv1d_step", "gated_delta_step", "chunk_gated_delta_rule", "gated_delta_rule", "l2norm",
           "recurrent_gated_delta_rule"]
