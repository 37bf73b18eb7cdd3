"""The decoder-only transformer every supported family shares (pre-norm, RoPE, GQA, gated MLP
or sparse MoE), over referenced weight tensors and paged K/V.

A family (``llama.py``, ``qwen2.py``, ``qwen3.py``, ``qwen3_moe.py``) is a small subclass of
:class:`CausalLM` that states what its checkpoints hold (q/k norms, qkv biases, MoE layers).

Per layer, as transformers computes it: ``h = x + o_proj(attn(rope(q), rope(k), v))`` over the
normed ``x``, then ``out = h + mlp(norm(h))``; new K/V are written into their blocks before
attention reads the sequence through its block table. ``forward`` returns the last layer's
hidden states *before* the final norm for every token; :meth:`CausalLM.logits` applies the
final norm and the LM head to the rows the step samples only (norm and head are per-row, so
this equals computing them for every token and selecting).

Weights: looked up by Hugging Face name (``model.layers.{i}.self_attn.q_proj.weight``, ...)
and referenced, never copied. A missing tensor is :class:`WeightsMismatch` naming it; tensors
the model does not use are listed in ``unused_weights``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from xllm_vmm.engine.layers.embedding import LMHead, VocabEmbedding
from xllm_vmm.engine.layers.linear import (ColumnParallelLinear, MergedColumnLinear,
                                           RowParallelLinear)
from xllm_vmm.engine.layers.mlp import GatedMLP, check_activation
from xllm_vmm.engine.layers.moe import SparseMoE
from xllm_vmm.engine.layers.norm import RMSNorm
from xllm_vmm.engine.layers.parallel import SINGLE, TensorParallel
from xllm_vmm.engine.layers.rotary import RotaryEmbedding
from xllm_vmm.engine.models.config import ModelConfig
from xllm_vmm.models.errors import ModelConfigError

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

    from xllm_vmm.engine.attention.base import AttentionBackend
    from xllm_vmm.engine.attention.kv import PagedKV


class WeightsMismatch(ValueError):
    """The checkpoint's tensors do not match the model (names the tensor and what differs)."""


class _Weights:
    """Name lookup over the checkpoint mapping that records what was used."""

    def __init__(self, tensors: Mapping[str, Tensor], architecture: str,
                 tp: TensorParallel = SINGLE) -> None:
        self.tensors = tensors
        self.architecture = architecture
        self.tp = tp
        self.used: set[str] = set()

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> Tensor:
        t = self.tensors.get(name)
        if t is None:
            raise WeightsMismatch(f"the checkpoint has no tensor {name!r}, which "
                                  f"{self.architecture} needs; is config.json's architecture right?")
        if shape is not None and self.tp.shard_hook is not None:  # tensor parallel: this rank's part
            shape = self.tp.held_shape(name, shape)
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise WeightsMismatch(f"tensor {name!r} has shape {tuple(t.shape)}, config.json "
                                  f"implies {tuple(shape)}")
        self.used.add(name)
        return t

    def maybe(self, name: str) -> Tensor | None:
        return self.get(name) if name in self.tensors else None

    def has(self, name: str) -> bool:
        return name in self.tensors


class Attention:
    """Self-attention of one layer: q/k/v column-parallel (heads split), o row-parallel."""

    def __init__(self, cfg: ModelConfig, w: _Weights, prefix: str, *, tp: TensorParallel,
                 rotary: RotaryEmbedding, qk_norm: bool, qkv_bias: bool | None) -> None:
        h, hkv, d, hid = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size

        def bias(name: str):
            if qkv_bias is True:
                return w.get(f"{prefix}.{name}.bias")
            return w.maybe(f"{prefix}.{name}.bias") if qkv_bias is None else None

        self.q_proj = ColumnParallelLinear(w.get(f"{prefix}.q_proj.weight", (h * d, hid)),
                                           bias("q_proj"), tp=tp, what="attention heads")
        self.k_proj = ColumnParallelLinear(w.get(f"{prefix}.k_proj.weight", (hkv * d, hid)),
                                           bias("k_proj"), tp=tp, what="KV heads")
        self.v_proj = ColumnParallelLinear(w.get(f"{prefix}.v_proj.weight", (hkv * d, hid)),
                                           bias("v_proj"), tp=tp, what="KV heads")
        self.o_proj = RowParallelLinear(w.get(f"{prefix}.o_proj.weight", (hid, h * d)),
                                        w.maybe(f"{prefix}.o_proj.bias"), tp=tp,
                                        what="attention heads")
        # one product over q/k/v when their weights lie back to back (plain weights are re-laid
        # so at load: fusion.colocate_projections; the pool's image places them so); else three
        self.qkv = MergedColumnLinear.of([self.q_proj, self.k_proj, self.v_proj])
        self.q_norm = self.k_norm = None
        if qk_norm:
            self.q_norm = RMSNorm(w.get(f"{prefix}.q_norm.weight", (d,)), cfg.rms_norm_eps)
            self.k_norm = RMSNorm(w.get(f"{prefix}.k_norm.weight", (d,)), cfg.rms_norm_eps)
        self.rotary = rotary
        self.num_heads = h // tp.world_size
        self.num_kv_heads = max(1, hkv // tp.world_size)
        self.head_dim = d

    def __call__(self, x: Tensor, positions: Tensor, kv: PagedKV, backend: AttentionBackend,
                 meta: Any) -> Tensor:
        t = x.shape[0]
        if self.qkv is not None:  # views of one product: rows at its stride
            q, k, v = self.qkv(x)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary.apply_(positions, q, k)  # native: in place (strided q: a new one)
        backend.write_kv(kv, k, v, meta)
        o = backend.attend(q, k, v, kv, meta)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class DecoderLayer:
    def __init__(self, attn: Attention, mlp: Any, input_norm: RMSNorm, post_norm: RMSNorm) -> None:
        self.attn, self.mlp = attn, mlp
        self.input_norm, self.post_norm = input_norm, post_norm

    def forward(self, x: Tensor, residual: Tensor | None, positions: Tensor, kv: PagedKV,
                backend: AttentionBackend, meta: Any) -> tuple[Tensor, Tensor]:
        """vLLM's residual pattern: the layer's input is ``x + residual`` (``residual`` None: just
        ``x``, which becomes the residual stream and is then updated in place); returns the MLP's
        output and the residual stream, whose sum is the layer's output. Each norm is fused
        with the add before it (``RMSNorm.add``); the sums and their roundings are those of
        ``h = x + attn(norm(x)); out = h + mlp(norm(h))``."""
        if residual is None:
            residual = x
            h = self.input_norm(x)
        else:
            h = self.input_norm.add(x, residual)
        h = self.attn(h, positions, kv, backend, meta)
        return self.mlp(self.post_norm.add(h, residual)), residual

    def __call__(self, x: Tensor, positions: Tensor, kv: PagedKV, backend: AttentionBackend,
                 meta: Any) -> Tensor:
        """The layer's output ``h + mlp(norm(h))``, ``h = x + attn(norm(x))`` (``x`` unchanged)."""
        out, residual = self.forward(x.clone(), None, positions, kv, backend, meta)
        return residual.add_(out)


class CausalLM:
    """A decoder-only causal LM over referenced weights.

    Family knobs (class attributes): ``qk_norm`` (per-head RMS norm of q and k, Qwen3),
    ``qkv_bias`` (True: required, False: none, None: used when the checkpoint has them),
    ``sparse`` (MoE layers where :meth:`ModelConfig.is_sparse_layer`), ``tensor_parallel``
    (False: the family runs on one worker only; checked at start-up before workers spawn).
    """

    architectures: tuple[str, ...] = ()
    tensor_parallel = True
    qk_norm = False
    qkv_bias: bool | None = None
    sparse = False

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, Tensor], *,
                 tp: TensorParallel = SINGLE, device: Any = None) -> None:
        check_activation(cfg.hidden_act)
        if cfg.sliding_window:
            raise ModelConfigError(
                f"{cfg.architecture} with use_sliding_window=true is not supported by the engine",
                hint="sliding-window layers need the 'sliding' cache group; set "
                     "use_sliding_window to false in config.json if the model allows it")
        self.config = cfg
        self.tp = tp
        w = _Weights(weights, cfg.architecture, tp)
        eps = cfg.rms_norm_eps
        self.embed = VocabEmbedding(w.get("model.embed_tokens.weight",
                                          (cfg.vocab_size, cfg.hidden_size)), tp=tp)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings,
                                      device=device)
        self.layers: list[DecoderLayer] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}"
            attn = Attention(cfg, w, f"{p}.self_attn", tp=tp, rotary=self.rotary,
                             qk_norm=self.qk_norm, qkv_bias=self.qkv_bias)
            mlp = self._mlp(cfg, w, f"{p}.mlp", i)
            self.layers.append(DecoderLayer(
                attn, mlp, RMSNorm(w.get(f"{p}.input_layernorm.weight", (cfg.hidden_size,)), eps),
                RMSNorm(w.get(f"{p}.post_attention_layernorm.weight", (cfg.hidden_size,)), eps)))
        self.norm = RMSNorm(w.get("model.norm.weight", (cfg.hidden_size,)), eps)
        head = w.maybe("lm_head.weight")
        if head is None:
            if not cfg.tie_word_embeddings:
                w.get("lm_head.weight")  # raises: untied model without a head
            head = self.embed.weight
        self.lm_head = LMHead(head, tp=tp)
        self.unused_weights = sorted(set(weights) - w.used)

    def _mlp(self, cfg: ModelConfig, w: _Weights, prefix: str, i: int):
        if self.sparse and cfg.is_sparse_layer(i):
            e, hid, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
            e0, e1 = self.tp.expert_range(e)  # ep_size > 1: only this rank's experts
            experts = [(w.get(f"{prefix}.experts.{j}.gate_proj.weight", (inter, hid)),
                        w.get(f"{prefix}.experts.{j}.up_proj.weight", (inter, hid)),
                        w.get(f"{prefix}.experts.{j}.down_proj.weight", (hid, inter)))
                       if e0 <= j < e1 else None for j in range(e)]
            return SparseMoE(w.get(f"{prefix}.gate.weight", (e, hid)), experts,
                             top_k=cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob,
                             tp=self.tp)
        hid, inter = cfg.hidden_size, cfg.intermediate_size
        return GatedMLP(w.get(f"{prefix}.gate_proj.weight", (inter, hid)),
                        w.get(f"{prefix}.up_proj.weight", (inter, hid)),
                        w.get(f"{prefix}.down_proj.weight", (hid, inter)), tp=self.tp,
                        gate_bias=w.maybe(f"{prefix}.gate_proj.bias"),
                        up_bias=w.maybe(f"{prefix}.up_proj.bias"),
                        down_bias=w.maybe(f"{prefix}.down_proj.bias"))

    @property
    def dtype(self):
        return self.embed.weight.dtype

    def forward(self, input_ids: Tensor, positions: Tensor, kv_layers: list[PagedKV],
                backend: AttentionBackend, meta: Any) -> Tensor:
        """Hidden states ``(T, hidden)`` of the last layer, before the final norm."""
        x = self.embed(input_ids)  # a new tensor: it becomes the residual stream (updated in place)
        residual = None
        for layer, kv in zip(self.layers, kv_layers):
            x, residual = layer.forward(x, residual, positions, kv, backend, meta)
        return residual.add_(x) if residual is not None else x

    def final_hidden(self, hidden: Tensor) -> Tensor:
        """The final norm (what the LM head and an MTP draft read)."""
        return self.norm(hidden)

    def logits(self, normed: Tensor) -> Tensor:
        """``(N, vocab)`` float32 logits of already-normed rows."""
        import torch

        return self.lm_head(normed).to(torch.float32)
