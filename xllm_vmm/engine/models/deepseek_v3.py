"""DeepSeek-V3 (and V2-shaped MLA checkpoints of the same architecture name): multi-head latent
attention on the ``"mla"`` cache group, dense feed-forward in the first
``first_k_dense_replace`` layers, then MoE with shared experts and DeepSeek's grouped sigmoid
routing — as transformers' ``DeepseekV3ForCausalLM`` computes it.

Routing per token (``DeepseekV3TopkRouter``): ``s = sigmoid(router(x))`` in float32; choice
scores ``s + e_score_correction_bias``; the ``topk_group`` groups (of ``n_group``) with the
largest sum of their two best choice scores stay eligible; the ``num_experts_per_tok`` best
eligible experts are selected, weighted by their ``s`` (renormalised to sum 1 when
``norm_topk_prob``) times ``routed_scaling_factor``. The shared experts (one gated MLP of
``moe_intermediate_size * n_shared_experts``) are added for every token.

The layout side (``plan``'s figures) is :func:`xllm_vmm.models.cache_layout`: one latent tensor
``layer{i}.latent`` of ``kv_lora_rank + qk_rope_head_dim`` elements per token per layer. The
model's MTP layers (``num_nextn_predict_layers``, stored as ``model.layers.{num_layers + k}``)
are not part of the target; they are listed in ``unused_weights``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Mapping

from xllm_vmm.engine.layers.embedding import LMHead, VocabEmbedding
from xllm_vmm.engine.layers.mla import MLAttention, mla_softmax_scale
from xllm_vmm.engine.layers.mlp import GatedMLP, check_activation
from xllm_vmm.engine.layers.moe import SparseMoE
from xllm_vmm.engine.layers.norm import RMSNorm
from xllm_vmm.engine.layers.parallel import SINGLE, TensorParallel
from xllm_vmm.engine.layers.rotary import RotaryEmbedding
from xllm_vmm.engine.models.config import ModelConfig
from xllm_vmm.engine.models.decoder import CausalLM, DecoderLayer, WeightsMismatch, _Weights

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor


def _field(raw: Mapping[str, Any], name: str, default: Any = None, *, required: bool = False):
    value = raw.get(name, default)
    if required and value is None:
        raise WeightsMismatch(f"config.json has no field {name!r}, which DeepseekV3ForCausalLM "
                              "needs (an MLA model)")
    return value


class GroupedSigmoidMoE(SparseMoE):
    """:class:`SparseMoE` with DeepSeek-V3's router (module docstring) and shared experts."""

    def __init__(self, router: Tensor, bias: Tensor | None, experts, shared: GatedMLP | None, *,
                 top_k: int, n_group: int, topk_group: int, norm_topk_prob: bool,
                 scaling: float, tp: TensorParallel = SINGLE) -> None:
        super().__init__(router, experts, top_k=top_k, norm_topk_prob=norm_topk_prob, tp=tp)
        e = len(experts)
        if n_group < 1 or e % n_group or not 1 <= topk_group <= n_group:
            raise WeightsMismatch(f"n_group {n_group} must divide n_routed_experts {e} and "
                                  f"topk_group {topk_group} be between 1 and n_group")
        self.bias = bias
        self.shared = shared
        self.n_group, self.topk_group, self.scaling = n_group, topk_group, float(scaling)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        import torch
        import torch.nn.functional as F

        scores = F.linear(x.to(torch.float32), self.router.weight.to(torch.float32)).sigmoid()
        choice = scores if self.bias is None else scores + self.bias.to(torch.float32)
        if self.n_group > 1:
            t, e = choice.shape
            per = e // self.n_group
            group_scores = choice.view(t, self.n_group, per).topk(min(2, per), dim=-1)[0].sum(-1)
            keep = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
            mask = torch.zeros_like(group_scores).scatter_(1, keep, 1.0).bool()
            mask = mask.unsqueeze(-1).expand(t, self.n_group, per).reshape(t, e)
            choice = choice.masked_fill(~mask, float("-inf"))
        idx = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, idx)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * self.scaling).to(x.dtype), idx

    def __call__(self, x: Tensor) -> Tensor:
        out = super().__call__(x)
        return out if self.shared is None else out + self.shared(x)


class DeepseekV3ForCausalLM(CausalLM):
    """DeepSeek-V3 over referenced weights (see the module docstring). ``self.config`` is the
    :class:`ModelConfig` with ``head_dim`` = ``qk_nope + qk_rope`` and the routed experts filled
    in (what the runner's execution-peak bound reads)."""

    architectures = ("DeepseekV3ForCausalLM",)
    # The execution-peak bound then takes the wider of the dense and the routed intermediates
    # (this model has both kinds of layers).
    sparse = False
    cache_group = "mla"

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, Tensor], *,
                 tp: TensorParallel = SINGLE, device: Any = None) -> None:
        check_activation(cfg.hidden_act)
        raw = cfg.raw
        r = int(_field(raw, "kv_lora_rank", required=True))
        dr = int(_field(raw, "qk_rope_head_dim", required=True))
        dn = int(_field(raw, "qk_nope_head_dim", required=True))
        dv = int(_field(raw, "v_head_dim", required=True))
        q_lora = _field(raw, "q_lora_rank")
        experts = int(_field(raw, "n_routed_experts", 0) or 0)
        self.config = dataclasses.replace(
            cfg, head_dim=dn + dr, num_kv_heads=cfg.num_heads, num_experts=experts,
            num_experts_per_tok=int(_field(raw, "num_experts_per_tok", 0) or 0))
        cfg = self.config
        self.tp = tp
        self.kv_lora_rank, self.qk_rope_head_dim, self.num_heads = r, dr, cfg.num_heads
        w = _Weights(weights, cfg.architecture, tp)  # several workers: shapes of this rank's part
        eps, hid = cfg.rms_norm_eps, cfg.hidden_size
        self.embed = VocabEmbedding(w.get("model.embed_tokens.weight", (cfg.vocab_size, hid)),
                                    tp=tp)
        self.rotary = RotaryEmbedding(dr, cfg.rope, cfg.max_position_embeddings, device=device)
        self.softmax_scale = mla_softmax_scale(dn + dr, cfg.rope)
        interleave = bool(_field(raw, "rope_interleave", True))
        first_dense = int(_field(raw, "first_k_dense_replace", 0) or 0)
        self.layers: list[DecoderLayer] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}"
            attn = self._attention(w, f"{p}.self_attn", dict(
                hidden=hid, num_heads=cfg.num_heads,
                q_lora_rank=None if q_lora is None else int(q_lora), kv_lora_rank=r,
                qk_nope_head_dim=dn, qk_rope_head_dim=dr, v_head_dim=dv, rotary=self.rotary,
                interleave=interleave, maybe=w.maybe, tp=tp))
            mlp = self._dense(w, f"{p}.mlp", cfg.intermediate_size) if (
                experts == 0 or i < first_dense) else self._moe(w, f"{p}.mlp", raw, experts)
            self.layers.append(DecoderLayer(
                attn, mlp, RMSNorm(w.get(f"{p}.input_layernorm.weight", (hid,)), eps),
                RMSNorm(w.get(f"{p}.post_attention_layernorm.weight", (hid,)), eps)))
        self.norm = RMSNorm(w.get("model.norm.weight", (hid,)), eps)
        head = w.maybe("lm_head.weight")
        if head is None:
            if not cfg.tie_word_embeddings:
                w.get("lm_head.weight")  # raises: untied model without a head
            head = self.embed.weight
        self.lm_head = LMHead(head, tp=tp)
        self.unused_weights = sorted(set(weights) - w.used)

    def _attention(self, w: _Weights, prefix: str, kw: dict) -> MLAttention:
        return MLAttention(w.get, prefix, **kw)

    def _dense(self, w: _Weights, prefix: str, inter: int) -> GatedMLP:
        hid = self.config.hidden_size
        return GatedMLP(w.get(f"{prefix}.gate_proj.weight", (inter, hid)),
                        w.get(f"{prefix}.up_proj.weight", (inter, hid)),
                        w.get(f"{prefix}.down_proj.weight", (hid, inter)), tp=self.tp)

    def _moe(self, w: _Weights, prefix: str, raw: Mapping[str, Any], e: int) -> GroupedSigmoidMoE:
        hid = self.config.hidden_size
        inter = int(_field(raw, "moe_intermediate_size", required=True))
        e0, e1 = self.tp.expert_range(e)  # ep_size > 1: only this rank's experts
        experts = [(w.get(f"{prefix}.experts.{j}.gate_proj.weight", (inter, hid)),
                    w.get(f"{prefix}.experts.{j}.up_proj.weight", (inter, hid)),
                    w.get(f"{prefix}.experts.{j}.down_proj.weight", (hid, inter)))
                   if e0 <= j < e1 else None for j in range(e)]
        n_shared = int(_field(raw, "n_shared_experts", 0) or 0)
        shared = self._dense(w, f"{prefix}.shared_experts", inter * n_shared) if n_shared else None
        return GroupedSigmoidMoE(
            w.get(f"{prefix}.gate.weight", (e, hid)), w.maybe(f"{prefix}.gate.e_score_correction_bias"),
            experts, shared, top_k=int(_field(raw, "num_experts_per_tok", required=True)),
            n_group=int(_field(raw, "n_group", 1) or 1),
            topk_group=int(_field(raw, "topk_group", 1) or 1),
            norm_topk_prob=bool(_field(raw, "norm_topk_prob", True)),
            scaling=float(_field(raw, "routed_scaling_factor", 1.0) or 1.0), tp=self.tp)

    def make_kv(self, kv_cache: Any, *, compute_dtype: Any, attention_backend: str,
                device: Any) -> tuple[Any, Any]:
        """The latent-cache views over group ``"mla"`` and the MLA backend (the worker's hook
        for families whose cache is not the ``"attn"`` K/V group)."""
        from xllm_vmm.engine.attention.mla import LatentCacheViews, MLATorchBackend

        if attention_backend not in ("auto", "torch"):
            raise ValueError(f"attention backend {attention_backend!r} has no MLA path; MLA "
                             "models run on 'auto' / 'torch'")
        views = LatentCacheViews(kv_cache, num_layers=self.config.num_layers,
                                 latent_dim=self.kv_lora_rank + self.qk_rope_head_dim,
                                 compute_dtype=compute_dtype)
        backend = MLATorchBackend(views.geometry, num_heads=self.num_heads // self.tp.world_size,
                                  latent_dim=self.kv_lora_rank + self.qk_rope_head_dim,
                                  value_dim=self.kv_lora_rank, scale=self.softmax_scale,
                                  device=device)
        return views, backend


@dataclasses.dataclass
class _SparseMeta:
    mla: Any
    index: Any
    mla_chunks: list
    index_chunks: list


class _SparseBackend:
    """The latent backend and the index-key backend of DeepSeek-V3.2 (two cache groups, their
    own block tables and slots)."""

    name = "mla-sparse-torch"

    def __init__(self, mla: Any, index: Any) -> None:
        self.mla, self.index = mla, index

    def prepare(self, step: Any) -> _SparseMeta:
        return _SparseMeta(self.mla.prepare(step), self.index.prepare(step),
                           self.mla.chunk_rows(step), self.index.chunk_rows(step))

    def workspace_bytes(self, meta: _SparseMeta, elem: int) -> int:
        return self.mla.workspace_bytes(meta.mla, elem) + self.index.workspace_bytes(meta.index, elem)


class _PairViews:
    def __init__(self, latent: Any, index: Any) -> None:
        self.latent, self.index = latent, index
        self.layers = list(zip(latent.layers, index.layers))
        self.geometry = latent.geometry
        self.dtype = latent.dtype

    def close(self) -> None:
        self.layers = []
        self.latent.close()
        self.index.close()


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2: DeepSeek-V3 with sparse attention (transformers' ``DeepseekV32``): every
    MLA layer's :class:`~xllm_vmm.engine.layers.mla.Indexer` picks, per query, the
    ``index_topk`` keys attention sees; its keys (``index_head_dim`` per token per layer) are
    the layout's ``"index"`` group (``layer{i}.index``) beside the latents (MLA+INDEX). The main
    attention's rope is always interleaved."""

    architectures = ("DeepseekV32ForCausalLM",)

    def _attention(self, w: _Weights, prefix: str, kw: dict) -> MLAttention:
        from xllm_vmm.engine.layers.mla import Indexer, SparseMLAttention

        raw = self.config.raw
        kw = dict(kw, interleave=True)
        self.index_head_dim = int(_field(raw, "index_head_dim", required=True))
        indexer = Indexer(w.get, f"{prefix}.indexer", hidden=kw["hidden"],
                          q_lora_rank=int(_field(raw, "q_lora_rank", required=True)),
                          n_heads=int(_field(raw, "index_n_heads", required=True)),
                          head_dim=self.index_head_dim, rope_dim=kw["qk_rope_head_dim"],
                          topk=int(_field(raw, "index_topk", required=True)),
                          rotary=kw["rotary"])
        return SparseMLAttention(w.get, prefix, indexer=indexer, **kw)

    def make_kv(self, kv_cache: Any, *, compute_dtype: Any, attention_backend: str,
                device: Any) -> tuple[Any, Any]:
        from xllm_vmm.engine.attention.mla import LatentCacheViews, MLATorchBackend

        views, mla = super().make_kv(kv_cache, compute_dtype=compute_dtype,
                                     attention_backend=attention_backend, device=device)
        idx = LatentCacheViews(kv_cache, num_layers=self.config.num_layers,
                               latent_dim=self.index_head_dim, compute_dtype=compute_dtype,
                               group="index", suffix="index")
        index = MLATorchBackend(idx.geometry, num_heads=1, latent_dim=self.index_head_dim,
                                value_dim=self.index_head_dim, scale=1.0, device=device)
        return _PairViews(views, idx), _SparseBackend(mla, index)


__all__ = ["DeepseekV32ForCausalLM", "DeepseekV3ForCausalLM", "GroupedSigmoidMoE"]
