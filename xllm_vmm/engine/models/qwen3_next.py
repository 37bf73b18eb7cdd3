"""Qwen3-Next: a hybrid of Gated DeltaNet linear attention (with a causal conv) and gated full
attention, MoE with a gated shared expert — as transformers' ``Qwen3NextForCausalLM``
computes it.

Cache (HY-01): only the full-attention layers' K/V live in the VMM cache (group ``"attn"``,
tensors ``layer{i}.k``/``.v`` for the full-attention layer numbers ``i``); the linear layers'
conv and recurrent state is resident per sequence slot, outside the page pool
(:class:`~xllm_vmm.engine.layers.linear_attention.LinearStateCache`, sized exactly as
:class:`~xllm_vmm.models.spec.ResidentState` says), plus checkpoint slots holding the state at
block boundaries so a prefix-cache hit can resume (PC-02). Which slot a chunk uses, which
checkpoint it resumes from and where it saves are in the step
(``SeqChunk.state_slot / state_restore / state_saves``), decided driver-side by
:class:`xllm_vmm.engine.linear_state.LinearStateManager`.

Per layer as transformers: ``h = x + mixer(norm(x))``, ``out = h + mlp(norm(h))``, with
Qwen3-Next's norms ``x / rms(x) * (1 + w)`` (float32) for the hidden, final and q/k norms and
the gated ``w * x / rms(x) * silu(z)`` after the delta rule.

- Gated attention: ``q_proj`` gives per head ``[q, gate]``; q/k per-head norms; partial RoPE on
  the first ``head_dim * partial_rotary_factor`` dims; ``o_proj(attn * sigmoid(gate))``.
- Gated DeltaNet: ``in_proj_qkvz`` / ``in_proj_ba`` grouped per key head (q, k, v, z; b, a),
  causal conv over ``[q, k, v]`` with SiLU, ``beta = sigmoid(b)``,
  ``g = -exp(A_log) * softplus(a + dt_bias)``, the delta rule
  (:mod:`~xllm_vmm.engine.layers.linear_attention`), gated norm with ``z``, ``out_proj``.
- MoE layers (``(i + 1) % decoder_sparse_step == 0``, not in ``mlp_only_layers``): softmax
  top-k routing as Qwen3-MoE plus ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from xllm_vmm.engine.layers.embedding import LMHead, VocabEmbedding
from xllm_vmm.engine.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from xllm_vmm.engine.layers.linear_attention import (LinearStateCache, causal_conv1d,
                                                     causal_conv1d_step, gated_delta_rule,
                                                     gated_delta_step)
from xllm_vmm.engine.layers.mlp import GatedMLP, check_activation
from xllm_vmm.engine.layers.moe import SparseMoE
from xllm_vmm.engine.layers.parallel import SINGLE, TensorParallel
from xllm_vmm.engine.layers.rotary import RotaryEmbedding
from xllm_vmm.engine.models.config import ModelConfig
from xllm_vmm.engine.models.decoder import CausalLM, WeightsMismatch, _Weights

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

    from xllm_vmm.engine.step import StepInput


class OffsetRMSNorm:
    """Qwen3-Next's RMS norm: ``x / sqrt(mean(x^2) + eps) * (1 + w)`` in float32."""

    def __init__(self, weight: Tensor, eps: float) -> None:
        self.weight, self.eps = weight, eps

    def __call__(self, x: Tensor) -> Tensor:
        import torch

        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.to(torch.float32))).to(x.dtype)


def gated_rms_norm(x: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``w * (x / rms(x))`` (product in ``x``'s dtype) times ``silu(z)`` in float32."""
    import torch
    import torch.nn.functional as F

    dtype = x.dtype
    h = x.to(torch.float32)
    h = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (h * F.silu(z.to(torch.float32))).to(dtype)


@dataclass
class _Seq:
    q0: int
    q1: int
    start: int
    slot: int
    saves: list[int] = field(default_factory=list)  # block boundaries to snapshot at
    request_id: str = ""


@dataclass
class HybridMeta:
    attn: Any  # the K/V backend's metadata (full-attention layers)
    seqs: list[_Seq]


class HybridBackend:
    """The K/V backend of the full-attention layers plus the step's linear-state plan.

    :meth:`prepare` also applies the step's state starts before any layer runs: a chunk at
    ``start_pos == 0`` zeroes its slot, one with ``state_restore`` copies that checkpoint in.
    Snapshots of an earlier step nobody took are dropped."""

    def __init__(self, attn: Any, state: LinearStateCache) -> None:
        self.attn = attn
        self.state = state
        self.name = f"hybrid+{getattr(attn, 'name', 'attn')}"

    def prepare(self, step: StepInput) -> HybridMeta:
        seqs = []
        self.state.snapshots.clear()
        qsl = step.query_start_loc.tolist()
        for i, c in enumerate(step.chunks):
            if c.state_slot is None:
                raise ValueError(f"chunk {c.request_id!r} has no state_slot: a hybrid model's "
                                 "steps come from engine.linear_state.LinearStateManager")
            if c.start_pos == 0:
                self.state.reset(c.state_slot)
            elif c.state_restore is not None:
                self.state.restore(c.state_slot, c.state_restore)
            end = c.start_pos + len(c.token_ids)
            saves = sorted(p for p in c.state_saves if c.start_pos < p <= end)
            seqs.append(_Seq(qsl[i], qsl[i + 1], c.start_pos, c.state_slot, saves, c.request_id))
        return HybridMeta(self.attn.prepare(step), seqs)

    def workspace_bytes(self, meta: HybridMeta, elem: int) -> int:
        return self.attn.workspace_bytes(meta.attn, elem)


class GatedAttention:
    def __init__(self, cfg: ModelConfig, w: _Weights, prefix: str, *, tp: TensorParallel,
                 rotary: RotaryEmbedding, rotary_dim: int, kv_index: int) -> None:
        h, hkv, d, hid = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        self.q_proj = ColumnParallelLinear(w.get(f"{prefix}.q_proj.weight", (2 * h * d, hid)),
                                           w.maybe(f"{prefix}.q_proj.bias"), tp=tp,
                                           what="attention heads")
        self.k_proj = ColumnParallelLinear(w.get(f"{prefix}.k_proj.weight", (hkv * d, hid)),
                                           w.maybe(f"{prefix}.k_proj.bias"), tp=tp, what="KV heads")
        self.v_proj = ColumnParallelLinear(w.get(f"{prefix}.v_proj.weight", (hkv * d, hid)),
                                           w.maybe(f"{prefix}.v_proj.bias"), tp=tp, what="KV heads")
        self.o_proj = RowParallelLinear(w.get(f"{prefix}.o_proj.weight", (hid, h * d)),
                                        w.maybe(f"{prefix}.o_proj.bias"), tp=tp,
                                        what="attention heads")
        self.q_norm = OffsetRMSNorm(w.get(f"{prefix}.q_norm.weight", (d,)), cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(w.get(f"{prefix}.k_norm.weight", (d,)), cfg.rms_norm_eps)
        self.num_heads, self.num_kv_heads = h // tp.world_size, max(1, hkv // tp.world_size)
        self.head_dim, self.rotary, self.rotary_dim = d, rotary, rotary_dim
        self.kv_index = kv_index

    def __call__(self, x: Tensor, positions: Tensor, kv_layers: list, backend: HybridBackend,
                 meta: HybridMeta) -> Tensor:
        import torch

        t, d, rd = x.shape[0], self.head_dim, self.rotary_dim
        qg = self.q_proj(x).view(t, self.num_heads, 2 * d)
        q, gate = qg[..., :d], qg[..., d:].reshape(t, self.num_heads * d)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, d))
        v = self.v_proj(x).view(t, self.num_kv_heads, d)
        qr, kr = self.rotary(positions, q[..., :rd], k[..., :rd])
        q, k = torch.cat((qr, q[..., rd:]), -1), torch.cat((kr, k[..., rd:]), -1)
        kv = kv_layers[self.kv_index]
        backend.attn.write_kv(kv, k, v, meta.attn)
        o = backend.attn.attend(q, k, v, kv, meta.attn).reshape(t, self.num_heads * d)
        return self.o_proj(o * torch.sigmoid(gate))


class GatedDeltaNet:
    """Tensor parallel (weights sharded by the shard hook): this rank holds
    ``nk / W`` key heads with their ``nv / W`` value heads — its rows of ``in_proj_qkvz`` /
    ``in_proj_ba`` (grouped per key head), its ``dt_bias`` / ``A_log``, its three channel ranges
    ``[q, k, v]`` of the (whole) conv weight, its state (the plan's per-worker
    :class:`~xllm_vmm.models.spec.LinearStateDims`), and its columns of ``out_proj``, whose
    output is all-reduced."""

    def __init__(self, raw: Mapping[str, Any], w: _Weights, prefix: str, *, hidden: int,
                 eps: float, state_index: int, tp: TensorParallel = SINGLE) -> None:
        import torch

        nk, nv = int(raw["linear_num_key_heads"]), int(raw["linear_num_value_heads"])
        dk, dv = int(raw["linear_key_head_dim"]), int(raw["linear_value_head_dim"])
        kernel = int(raw["linear_conv_kernel_dim"])
        if nv % nk:
            raise WeightsMismatch(f"linear_num_value_heads {nv} must be a multiple of "
                                  f"linear_num_key_heads {nk}")
        full_key, full_value = nk * dk, nv * dv
        conv_dim = 2 * full_key + full_value
        W, r = tp.world_size, tp.rank
        nk, nv = nk // W, nv // W  # this rank's heads (start-up checked W divides both)
        self.nk, self.nv, self.dk, self.dv, self.eps = nk, nv, dk, dv, eps
        self.key_dim, self.value_dim = nk * dk, nv * dv
        self.in_qkvz = ColumnParallelLinear(
            w.get(f"{prefix}.in_proj_qkvz.weight", (2 * full_key + 2 * full_value, hidden)),
            tp=tp, what="linear_num_key_heads")
        self.in_ba = ColumnParallelLinear(w.get(f"{prefix}.in_proj_ba.weight", (2 * nv * W, hidden)),
                                          tp=tp, what="linear_num_key_heads")
        conv_w = w.get(f"{prefix}.conv1d.weight", (conv_dim, 1, kernel)).squeeze(1)
        if W > 1:  # this rank's q, k and v channels (a small copy)
            kd, vd = self.key_dim, self.value_dim
            conv_w = torch.cat((conv_w[r * kd:(r + 1) * kd],
                                conv_w[full_key + r * kd:full_key + (r + 1) * kd],
                                conv_w[2 * full_key + r * vd:2 * full_key + (r + 1) * vd]))
        self.conv_w = conv_w
        self.conv_b = w.maybe(f"{prefix}.conv1d.bias")
        if self.conv_b is not None:
            raise WeightsMismatch(f"{prefix}.conv1d.bias: a conv bias is not supported")
        self.dt_bias = w.get(f"{prefix}.dt_bias", (nv * W,))
        self.a_log = w.get(f"{prefix}.A_log", (nv * W,))
        if W > 1 and tp.shard_hook is None:  # full tensors: this rank's value heads
            self.dt_bias, self.a_log = (t.narrow(0, r * nv, nv) for t in (self.dt_bias, self.a_log))
        self.norm_w = w.get(f"{prefix}.norm.weight", (dv,))
        self.out_proj = RowParallelLinear(w.get(f"{prefix}.out_proj.weight", (hidden, full_value)),
                                          tp=tp, what="linear_num_value_heads")
        self.state_index = state_index

    def _split(self, x: Tensor):
        """q (T, nk, dk), k (T, nk, dk), v (T, nv, dv), z (T, nv, dv), b (T, nv), a (T, nv)."""
        t, nk, r = x.shape[0], self.nk, self.nv // self.nk
        qkvz = self.in_qkvz(x).view(t, nk, 2 * self.dk + 2 * r * self.dv)
        ba = self.in_ba(x).view(t, nk, 2 * r)
        dk, rv = self.dk, r * self.dv
        q, k = qkvz[..., :dk], qkvz[..., dk:2 * dk]
        v, z = qkvz[..., 2 * dk:2 * dk + rv], qkvz[..., 2 * dk + rv:]
        b, a = ba[..., :r].reshape(t, self.nv), ba[..., r:].reshape(t, self.nv)
        return q, k, v.reshape(t, self.nv, self.dv), z.reshape(t, self.nv, self.dv), b, a

    def __call__(self, x: Tensor, positions: Tensor, kv_layers: list, backend: HybridBackend,
                 meta: HybridMeta) -> Tensor:
        import torch
        import torch.nn.functional as F

        t = x.shape[0]
        q, k, v, z, b, a = self._split(x)
        mixed = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)
        beta = b.sigmoid()
        g = -self.a_log.to(torch.float32).exp() * F.softplus(a.to(torch.float32) + self.dt_bias)
        state, li = backend.state, self.state_index
        out = torch.empty((t, self.nv, self.dv), dtype=x.dtype, device=x.device)
        kd = self.key_dim
        seqs = meta.seqs
        dec = [s for s in seqs if s.q1 - s.q0 == 1 and not s.saves]
        if len(dec) > 1:  # batched decode: one token of each sequence in one pass
            rows = torch.tensor([s.q0 for s in dec], device=x.device)
            slots = torch.tensor([s.slot for s in dec], device=x.device)
            y, new_conv = causal_conv1d_step(mixed[rows], state.conv[slots, li], self.conv_w)
            yq = y[:, :kd].reshape(-1, self.nk, self.dk)
            yk = y[:, kd:2 * kd].reshape(-1, self.nk, self.dk)
            yv = y[:, 2 * kd:].reshape(-1, self.nv, self.dv)
            o, new_rec = gated_delta_step(yq, yk, yv, g[rows], beta[rows], state.rec[slots, li])
            out[rows] = o
            state.conv[slots, li] = new_conv.to(state.conv.dtype)
            state.rec[slots, li] = new_rec.to(state.rec.dtype)
            done = {id(s) for s in dec}
            seqs = [s for s in seqs if id(s) not in done]
        for s in seqs:
            conv, rec = state.conv[s.slot, li], state.rec[s.slot, li]
            cuts = s.saves + [s.start + (s.q1 - s.q0)]
            at = s.start
            for cut, save in zip(cuts, s.saves + [None]):
                r0, r1 = s.q0 + at - s.start, s.q0 + cut - s.start
                if r1 > r0:
                    y, new_conv = causal_conv1d(mixed[r0:r1], conv, self.conv_w)
                    yq = y[:, :kd].reshape(-1, self.nk, self.dk)
                    yk = y[:, kd:2 * kd].reshape(-1, self.nk, self.dk)
                    yv = y[:, 2 * kd:].reshape(-1, self.nv, self.dv)
                    o, new_rec = gated_delta_rule(yq, yk, yv, g[r0:r1], beta[r0:r1], rec)
                    out[r0:r1] = o
                    conv.copy_(new_conv)
                    rec.copy_(new_rec)
                if save is not None:
                    state.save(s.slot, (s.request_id, save), li)
                at = cut
        o = gated_rms_norm(out, z, self.norm_w, self.eps)
        return self.out_proj(o.reshape(t, self.value_dim))


class _HybridLayer:
    def __init__(self, mixer: Any, mlp: Any, input_norm: OffsetRMSNorm,
                 post_norm: OffsetRMSNorm) -> None:
        self.mixer, self.mlp, self.input_norm, self.post_norm = mixer, mlp, input_norm, post_norm

    @property
    def attn(self):  # the name other families use for the layer's mixer
        return self.mixer

    def __call__(self, x, positions, kv_layers, backend, meta):
        h = x + self.mixer(self.input_norm(x), positions, kv_layers, backend, meta)
        return h + self.mlp(self.post_norm(h))


class SharedExpertMoE(SparseMoE):
    """Qwen3-MoE routing plus ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``."""

    def __init__(self, router, experts, shared: GatedMLP, shared_gate: Tensor, **kw) -> None:
        super().__init__(router, experts, **kw)
        self.shared, self.shared_gate = shared, ReplicatedLinear(shared_gate)

    def __call__(self, x: Tensor) -> Tensor:
        import torch

        return super().__call__(x) + torch.sigmoid(self.shared_gate(x)) * self.shared(x)


class Qwen3NextForCausalLM(CausalLM):
    """Qwen3-Next over referenced weights (module docstring). ``full_layers`` / ``linear_layers``
    are the layer numbers of each kind (``layer_types`` of config.json)."""

    architectures = ("Qwen3NextForCausalLM",)
    sparse = True
    tp_prefix_cache = False
    """Several workers: no prefix cache (a linear-state checkpoint is a per-worker shard; rank
    0's cannot be restored on the others) — refused at start-up naming the flag."""

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, Tensor], *,
                 tp: TensorParallel = SINGLE, device: Any = None) -> None:
        check_activation(cfg.hidden_act)
        raw = cfg.raw
        self.config, self.tp = cfg, tp
        kinds = self._layer_types(cfg)
        self.full_layers = [i for i, k in enumerate(kinds) if k == "full_attention"]
        self.linear_layers = [i for i, k in enumerate(kinds) if k == "linear_attention"]
        w = _Weights(weights, cfg.architecture, tp)  # several workers: shapes of this rank's part
        eps, hid = cfg.rms_norm_eps, cfg.hidden_size
        self.embed = VocabEmbedding(w.get("model.embed_tokens.weight", (cfg.vocab_size, hid)), tp=tp)
        factor = float(cfg.rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
        rotary_dim = int(cfg.head_dim * factor)
        self.rotary = RotaryEmbedding(rotary_dim, cfg.rope, cfg.max_position_embeddings,
                                      device=device)
        self.layers: list[_HybridLayer] = []
        for i, kind in enumerate(kinds):
            p = f"model.layers.{i}"
            if kind == "full_attention":
                mixer = GatedAttention(cfg, w, f"{p}.self_attn", tp=tp, rotary=self.rotary,
                                       rotary_dim=rotary_dim,
                                       kv_index=self.full_layers.index(i))
            else:
                mixer = GatedDeltaNet(raw, w, f"{p}.linear_attn", hidden=hid, eps=eps,
                                      state_index=self.linear_layers.index(i), tp=tp)
            self.layers.append(_HybridLayer(
                mixer, self._mlp(cfg, w, f"{p}.mlp", i),
                OffsetRMSNorm(w.get(f"{p}.input_layernorm.weight", (hid,)), eps),
                OffsetRMSNorm(w.get(f"{p}.post_attention_layernorm.weight", (hid,)), eps)))
        self.norm = OffsetRMSNorm(w.get("model.norm.weight", (hid,)), eps)
        head = w.maybe("lm_head.weight")
        if head is None:
            if not cfg.tie_word_embeddings:
                w.get("lm_head.weight")
            head = self.embed.weight
        self.lm_head = LMHead(head, tp=tp)
        self.unused_weights = sorted(set(weights) - w.used)
        self._state_args: dict[str, Any] = {}

    @staticmethod
    def _layer_types(cfg: ModelConfig) -> list[str]:
        raw = cfg.raw
        types = raw.get("layer_types")
        if types is None:
            n = int(raw.get("full_attention_interval") or 4)
            types = ["full_attention" if (i + 1) % n == 0 else "linear_attention"
                     for i in range(cfg.num_layers)]
        types = list(types)[:cfg.num_layers]
        bad = sorted({t for t in types if t not in ("full_attention", "linear_attention")})
        if bad or len(types) != cfg.num_layers:
            raise WeightsMismatch(f"config.json layer_types must list full_attention / "
                                  f"linear_attention for each of {cfg.num_layers} layers, got {types}")
        return types

    def _mlp(self, cfg: ModelConfig, w: _Weights, prefix: str, i: int):
        if not cfg.is_sparse_layer(i):
            return GatedMLP(
                w.get(f"{prefix}.gate_proj.weight", (cfg.intermediate_size, cfg.hidden_size)),
                w.get(f"{prefix}.up_proj.weight", (cfg.intermediate_size, cfg.hidden_size)),
                w.get(f"{prefix}.down_proj.weight", (cfg.hidden_size, cfg.intermediate_size)),
                tp=self.tp)
        e, hid, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        e0, e1 = self.tp.expert_range(e)  # ep_size > 1: only this rank's experts
        experts = [(w.get(f"{prefix}.experts.{j}.gate_proj.weight", (inter, hid)),
                    w.get(f"{prefix}.experts.{j}.up_proj.weight", (inter, hid)),
                    w.get(f"{prefix}.experts.{j}.down_proj.weight", (hid, inter)))
                   if e0 <= j < e1 else None for j in range(e)]
        si = int(cfg.raw.get("shared_expert_intermediate_size") or 0)
        shared = GatedMLP(w.get(f"{prefix}.shared_expert.gate_proj.weight", (si, hid)),
                          w.get(f"{prefix}.shared_expert.up_proj.weight", (si, hid)),
                          w.get(f"{prefix}.shared_expert.down_proj.weight", (hid, si)), tp=self.tp)
        return SharedExpertMoE(w.get(f"{prefix}.gate.weight", (e, hid)), experts, shared,
                               w.get(f"{prefix}.shared_expert_gate.weight", (1, hid)),
                               top_k=cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob,
                               tp=self.tp)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_layers: list,
                backend: HybridBackend, meta: HybridMeta) -> Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, positions, kv_layers, backend, meta)
        return x

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per linear layer and sequence on this worker: conv ``(conv_dim, kernel - 1)``,
        recurrent ``(num_v_heads, k_dim, v_dim)`` (elements; heads ``/ W`` on ``W`` workers, as
        :meth:`~xllm_vmm.models.spec.LinearStateDims.per_worker` sizes the plan's)."""
        raw = self.config.raw
        nk, nv = int(raw["linear_num_key_heads"]), int(raw["linear_num_value_heads"])
        nk, nv = nk // self.tp.world_size, nv // self.tp.world_size
        dk, dv = int(raw["linear_key_head_dim"]), int(raw["linear_value_head_dim"])
        return (2 * nk * dk + nv * dv, int(raw["linear_conv_kernel_dim"]) - 1), (nv, dk, dv)

    def make_kv(self, kv_cache: Any, *, compute_dtype: Any, attention_backend: str,
                device: Any) -> tuple[Any, Any]:
        """K/V views of the full-attention layers (group ``"attn"``) and the hybrid backend
        over a :class:`LinearStateCache` without slots yet (the driver side sizes it:
        :meth:`LinearStateCache.reserve`; the worker exposes it as ``backend.state``)."""
        from xllm_vmm.engine.attention import KVCacheViews, select_backend

        cfg, w = self.config, self.tp.world_size
        heads_kv = max(1, cfg.num_kv_heads // w)  # this worker's (split or one replicated)
        views = KVCacheViews(kv_cache, num_layers=len(self.full_layers),
                             num_kv_heads=heads_kv, head_dim=cfg.head_dim,
                             compute_dtype=compute_dtype, layer_ids=self.full_layers)
        attn = select_backend(attention_backend, views.geometry, num_heads=cfg.num_heads // w,
                              num_kv_heads=heads_kv, head_dim=cfg.head_dim,
                              device=device)
        conv, rec = self.state_shapes()
        state = LinearStateCache(len(self.linear_layers), conv, rec, dtype=compute_dtype,
                                 device=device)
        return views, HybridBackend(attn, state)


__all__ = ["HybridBackend", "OffsetRMSNorm", "Qwen3NextForCausalLM", "gated_rms_norm"]
