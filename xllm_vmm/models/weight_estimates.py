"""Parameter count and weight bytes estimated from a model's architecture.

Used when a model has no safetensors files to read (a catalogue name, a config-only directory).
The estimate counts every weight matrix, bias and norm vector of the decoder (MoE experts,
shared experts and routers included; tied embeddings counted once), the vision tower of a VLM,
and, separately, the MTP layers (which are loaded only with an MTP draft).

Storage, per part:

- unquantized: ``params x dtype bytes`` (the model's ``torch_dtype``);
- ``quant_method: fp8`` (DeepSeek style): linear layers of attention and MLP/experts at 1 byte
  per weight plus one float32 scale per 128 x 128 block; embeddings, LM head, norms and routers
  at the model dtype;
- ``quant_method: mxfp4`` (gpt-oss): MoE expert matrices at 4 bits per weight plus one 1-byte
  scale per 32 weights; everything else at the model dtype;
- other methods with ``bits`` (GPTQ/AWQ style): linear layers at ``bits`` per weight plus a
  2-byte scale and a 2-byte zero per ``group_size`` (default 128) weights; GPTQ/AWQ without
  ``bits`` at their tools' default of 4, any other method without it unquantized — either way
  the assumption is recorded and the plan warns with it (WEIGHTS).

Exact bytes come from safetensors headers (:mod:`xllm_vmm.models.safetensors_header`) when the
files are there; the estimate is then only informational.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from xllm_vmm.models.dtypes import dtype_bytes
from xllm_vmm.models.spec import LayerKind, ModelSpec

# Model types whose attention has biases / per-head q,k norms / an output gate, by default.
_QKV_BIAS = {"qwen2", "qwen2_moe", "qwen2_vl", "qwen2_5_vl", "glm4_moe", "glm4"}
_QKVO_BIAS = {"gpt_oss"}
_QK_NORM = {"qwen3", "qwen3_moe", "qwen3_next"}
_OUTPUT_GATE = {"qwen3_next"}


@dataclass
class WeightEstimate:
    """Parameters and bytes by part. ``parts`` maps a part name to (params, bytes)."""

    params: int = 0
    bytes: int = 0
    parts: dict[str, tuple[int, int]] = field(default_factory=dict)

    def add(self, part: str, params: int, nbytes: int) -> None:
        p, b = self.parts.get(part, (0, 0))
        self.parts[part] = (p + params, b + nbytes)
        self.params += params
        self.bytes += nbytes


_DEFAULT_BITS = {"gptq": 4, "gptq_marlin": 4, "awq": 4, "awq_marlin": 4, "marlin": 4}
"""Bits per weight of methods whose configs may leave ``bits`` out (their tools' defaults)."""


class _Storage:
    """Bytes of a weight matrix under the model's quantization."""

    def __init__(self, spec: ModelSpec, cfg: dict[str, Any]) -> None:
        self.elem = dtype_bytes(spec.dtype)
        q = cfg.get("quantization_config") if isinstance(cfg.get("quantization_config"), dict) else {}
        self.method = (spec.quantization or "").lower()
        self.bits = int(q.get("bits") or 0) if isinstance(q.get("bits"), (int, float)) else 0
        self.group = int(q.get("group_size") or 128) if isinstance(q.get("group_size"), int) else 128
        block = q.get("weight_block_size") or [128, 128]
        self.block = (int(block[0]), int(block[1])) if isinstance(block, list) and len(block) == 2 else (128, 128)
        #: what was assumed about a width the config does not give (None: nothing assumed)
        self.assumed: str | None = None
        if self.method and self.method not in ("fp8", "mxfp4") and not self.bits:
            if self.method in _DEFAULT_BITS:
                self.bits = _DEFAULT_BITS[self.method]
                self.assumed = (f"quantization_config has quant_method {self.method!r} but no "
                                f"bits: {self.bits} bits per weight assumed ({self.method}'s "
                                f"default), with a 2-byte scale and zero per {self.group} weights")
            else:
                self.assumed = (f"quantization_config has quant_method {self.method!r} with no "
                                f"bits this estimate can use: the weights are sized "
                                f"unquantized ({spec.dtype})")

    def plain(self, params: int) -> int:
        return params * self.elem

    def linear(self, n_in: int, n_out: int, *, expert: bool = False) -> int:
        """Bytes of one ``n_in x n_out`` matrix of attention or MLP (no bias)."""
        n = n_in * n_out
        if self.method == "fp8":
            bo, bi = self.block
            return n + (-(-n_out // bo)) * (-(-n_in // bi)) * 4
        if self.method == "mxfp4":
            return n // 2 + n // 32 if expert else n * self.elem
        if self.bits:
            return n * self.bits // 8 + (n // self.group) * 4
        return n * self.elem


def _attention(spec: ModelSpec, cfg: dict[str, Any], st: _Storage, est: WeightEstimate,
               part: str) -> None:
    """One full/sliding attention layer (MHA/GQA), its norms included."""
    h, hd, nq, nkv = spec.hidden_size, spec.head_dim, spec.num_attention_heads, spec.num_kv_heads
    mt = spec.model_type
    gate = 2 if (cfg.get("attn_output_gate", mt in _OUTPUT_GATE)) else 1
    q_out = nq * hd * gate
    params = h * q_out + 2 * h * nkv * hd + nq * hd * h
    nbytes = st.linear(h, q_out) + 2 * st.linear(h, nkv * hd) + st.linear(nq * hd, h)
    small = 0
    bias = cfg.get("attention_bias", mt in _QKV_BIAS or mt in _QKVO_BIAS)
    if bias:
        small += q_out + 2 * nkv * hd
        if mt in _QKVO_BIAS or cfg.get("o_proj_bias"):
            small += h
    if mt in _QK_NORM or cfg.get("use_qk_norm"):
        small += 2 * hd
    if mt == "gpt_oss":
        small += nq  # attention sinks
    est.add(part, params + small, nbytes + st.plain(small))


def _mla(spec: ModelSpec, st: _Storage, est: WeightEstimate, part: str) -> None:
    m = spec.mla
    assert m is not None
    h, n = spec.hidden_size, spec.num_attention_heads
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    v = m.v_head_dim or m.qk_nope_head_dim
    params = 0
    nbytes = 0
    small = 0
    if m.q_lora_rank:
        params += h * m.q_lora_rank + m.q_lora_rank * n * qk
        nbytes += st.linear(h, m.q_lora_rank) + st.linear(m.q_lora_rank, n * qk)
        small += m.q_lora_rank  # q_a_layernorm
    else:
        params += h * n * qk
        nbytes += st.linear(h, n * qk)
    params += h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * n * (m.qk_nope_head_dim + v)
    nbytes += st.linear(h, m.kv_lora_rank + m.qk_rope_head_dim)
    nbytes += st.linear(m.kv_lora_rank, n * (m.qk_nope_head_dim + v))
    small += m.kv_lora_rank  # kv_a_layernorm
    params += n * v * h
    nbytes += st.linear(n * v, h)
    if m.index_head_dim:
        # DeepSeek-V3.2 indexer: wq_b, wk, k_norm (weight + bias), weights_proj.
        q_in = m.q_lora_rank or h
        ih, idim = m.index_n_heads, m.index_head_dim
        params += q_in * ih * idim + h * idim
        nbytes += st.linear(q_in, ih * idim) + st.linear(h, idim)
        small += 2 * idim + h * ih
    est.add(part, params + small, nbytes + st.plain(small))


def _linear_attention(spec: ModelSpec, st: _Storage, est: WeightEstimate, part: str) -> None:
    """One gated delta-net layer (Qwen3-Next)."""
    ls = spec.linear_state
    assert ls is not None
    h = spec.hidden_size
    nk, nv, dk, dv = ls.num_key_heads, ls.num_value_heads, ls.key_head_dim, ls.value_head_dim
    if not (nk and nv):
        # SSM without head structure: count the state projections only.
        inner = ls.conv_elems // max(ls.conv_kernel - 1, 1)
        est.add(part, 2 * h * inner + inner * h, st.linear(h, 2 * inner) + st.linear(inner, h))
        return
    qkvz = 2 * nk * dk + 2 * nv * dv
    conv_dim = 2 * nk * dk + nv * dv
    params = h * qkvz + h * 2 * nv + nv * dv * h
    nbytes = st.linear(h, qkvz) + st.linear(h, 2 * nv) + st.linear(nv * dv, h)
    small = conv_dim * ls.conv_kernel + 2 * nv + dv  # conv1d, dt_bias + A_log, gated norm
    est.add(part, params + small, nbytes + st.plain(small))


def _moe_layers(spec: ModelSpec, cfg: dict[str, Any], num_layers: int) -> list[bool]:
    if not spec.num_experts:
        return [False] * num_layers
    if "first_k_dense_replace" in cfg or "moe_layer_freq" in cfg:
        k = int(cfg.get("first_k_dense_replace") or 0)
        freq = int(cfg.get("moe_layer_freq") or 1)
        return [i >= k and i % freq == 0 for i in range(num_layers)]
    only_dense = set(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step") or 1)
    return [i not in only_dense and (i + 1) % step == 0 for i in range(num_layers)]


def _mlp(spec: ModelSpec, cfg: dict[str, Any], st: _Storage, est: WeightEstimate,
         moe: bool, part: str) -> None:
    h = spec.hidden_size
    if not moe:
        inter = spec.intermediate_size
        est.add(part, 3 * h * inter, 2 * st.linear(h, inter) + st.linear(inter, h))
        return
    e = spec.num_experts
    inter = spec.moe_intermediate_size or spec.intermediate_size
    if spec.model_type == "gpt_oss":
        # gate_up_proj (h -> 2*inter, bias) and down_proj (inter -> h, bias) per expert.
        mats = h * 2 * inter + inter * h
        mat_bytes = st.linear(h, 2 * inter, expert=True) + st.linear(inter, h, expert=True)
        biases = 2 * inter + h
        est.add(part + ".experts", e * (mats + biases), e * (mat_bytes + st.plain(biases)))
        est.add(part + ".router", h * e + e, st.plain(h * e + e))
        return
    est.add(part + ".experts", e * 3 * h * inter,
            e * (2 * st.linear(h, inter, expert=True) + st.linear(inter, h, expert=True)))
    router = h * e + (e if "n_routed_experts" in cfg else 0)  # + e_score_correction_bias
    est.add(part + ".router", router, st.plain(router))
    shared_inter = int(cfg.get("shared_expert_intermediate_size") or 0)
    if shared_inter:
        est.add(part + ".shared", 3 * h * shared_inter + h,
                2 * st.linear(h, shared_inter) + st.linear(shared_inter, h) + st.plain(h))
    elif spec.num_shared_experts:
        si = inter * spec.num_shared_experts
        est.add(part + ".shared", 3 * h * si, 2 * st.linear(h, si) + st.linear(si, h))


def _decoder_layer(spec: ModelSpec, cfg: dict[str, Any], st: _Storage, est: WeightEstimate,
                   kind: LayerKind, moe: bool, prefix: str) -> None:
    if kind == LayerKind.MLA:
        _mla(spec, st, est, prefix + "attention")
    elif kind in (LayerKind.LINEAR, LayerKind.MAMBA):
        _linear_attention(spec, st, est, prefix + "linear_attention")
    else:
        _attention(spec, cfg, st, est, prefix + "attention")
    _mlp(spec, cfg, st, est, moe, prefix + "mlp")
    est.add(prefix + "norms", 2 * spec.hidden_size, st.plain(2 * spec.hidden_size))


def _vision(cfg: dict[str, Any], st: _Storage, est: WeightEstimate) -> None:
    vc = cfg.get("vision_config")
    if not isinstance(vc, dict):
        return
    vh = int(vc.get("hidden_size") or vc.get("embed_dim") or 0)
    vi = int(vc.get("intermediate_size") or 4 * vh)
    depth = int(vc.get("depth") or vc.get("num_hidden_layers") or 0)
    if not (vh and depth):
        return
    patch = int(vc.get("patch_size") or 14)
    temporal = int(vc.get("temporal_patch_size") or 1)
    channels = int(vc.get("in_channels") or vc.get("in_chans") or 3)
    params = channels * temporal * patch * patch * vh
    # Per block: two norms, qkv (bias), proj (bias), gated MLP (gate, up, down with biases).
    block = 2 * vh + (3 * vh * vh + 3 * vh) + (vh * vh + vh) + (2 * (vh * vi + vi) + vi * vh + vh)
    params += depth * block
    merge = int(vc.get("spatial_merge_size") or 1)
    out = int(vc.get("out_hidden_size") or 0)
    if out:
        m = vh * merge * merge
        params += vh + (m * m + m) + (m * out + out)  # merger: ln_q + 2-layer MLP
    est.add("vision", params, st.plain(params))


def estimate(spec: ModelSpec) -> tuple[WeightEstimate, WeightEstimate]:
    """(served model, MTP layers) parameter and byte estimates for ``spec``; what the estimate
    had to assume about the quantization width goes to ``spec.extra["weights_assumed"]`` (the
    planner warns with it)."""
    cfg = spec.extra.get("config", {})
    st = _Storage(spec, cfg)
    if st.assumed is not None:
        spec.extra["weights_assumed"] = st.assumed
    est = WeightEstimate()
    h, v = spec.hidden_size, spec.vocab_size
    est.add("embedding", v * h, st.plain(v * h))
    if not spec.tie_word_embeddings:
        est.add("lm_head", v * h, st.plain(v * h))
    moe = _moe_layers(spec, cfg, spec.num_layers + spec.mtp_layers)
    for i, kind in enumerate(spec.layer_kinds):
        _decoder_layer(spec, cfg, st, est, kind, moe[i], "layers.")
    est.add("final_norm", h, st.plain(h))
    _vision(cfg, st, est)
    mtp = WeightEstimate()
    mtp_kind = LayerKind.MLA if spec.mla else LayerKind.FULL
    for j in range(spec.mtp_layers):
        _decoder_layer(spec, cfg, st, mtp, mtp_kind, moe[spec.num_layers + j], "mtp.")
        # enorm, hnorm, shared-head norm, eh_proj (2h -> h); embedding and head are shared.
        mtp.add("mtp.proj", 3 * h + 2 * h * h, st.plain(3 * h) + st.linear(2 * h, h))
    return est, mtp


def with_estimate(spec: ModelSpec) -> ModelSpec:
    """``spec`` with ``param_count``, ``estimated_weight_bytes`` and the MTP figures filled in."""
    est, mtp = estimate(spec)
    return dataclasses.replace(spec, param_count=est.params, estimated_weight_bytes=est.bytes,
                               mtp_param_count=mtp.params, mtp_weight_bytes=mtp.bytes)
