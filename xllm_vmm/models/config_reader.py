"""``config.json`` (a dict) -> :class:`~xllm_vmm.models.spec.ModelSpec`.

Only the memory-sizing fields are read; unknown keys are ignored. Every problem raises a
:class:`~xllm_vmm.models.errors.ModelConfigError` that names the field and the file.

Layer kinds, in order of precedence:

1. ``layer_types`` (``full_attention``, ``sliding_attention``, ``linear_attention``, ``mamba``),
   or ``layers_block_type`` (``attention``, ``linear_attention``, ``mamba``);
2. ``full_attention_interval`` (Qwen3-Next): layer ``i`` is full attention when
   ``(i + 1) % interval == 0``, linear attention otherwise;
3. ``kv_lora_rank`` present: every layer is MLA;
4. ``sliding_window`` set and ``use_sliding_window`` not false: layers at or above
   ``max_window_layers`` slide (every layer when that key is absent);
5. otherwise every layer is full attention.
"""

from __future__ import annotations

from typing import Any

from xllm_vmm.models.dtypes import canonical_dtype
from xllm_vmm.models.errors import ModelConfigError
from xllm_vmm.models.spec import LayerKind, LinearStateDims, MlaDims, ModelSpec

_LAYER_TYPE_NAMES = {
    "full_attention": LayerKind.FULL,
    "attention": LayerKind.FULL,
    "global_attention": LayerKind.FULL,
    "sliding_attention": LayerKind.SLIDING,
    "sliding_window_attention": LayerKind.SLIDING,
    "local_attention": LayerKind.SLIDING,
    "linear_attention": LayerKind.LINEAR,
    "indexed_attention": LayerKind.MLA,  # DeepSeek-V3.2 sparse attention: MLA + index keys
    "mamba": LayerKind.MAMBA,
}

_HINT = ("pass a Hugging Face model directory whose config.json describes a decoder model, "
         "or a catalogue name (see `xllm-vmm plan --list-models`)")


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Multimodal configs that nest the decoder under ``text_config`` (or ``llm_config``) are
    flattened: the decoder's keys win over the top level's."""
    for key in ("text_config", "llm_config", "language_config"):
        inner = cfg.get(key)
        if isinstance(inner, dict) and "num_hidden_layers" in inner:
            merged = dict(cfg)
            merged.update(inner)
            return merged
    return cfg


#: The largest value a size field of config.json may hold (``None``: no bound beyond int64).
#: Far above any published model (the deepest has a few hundred layers, the widest vocabulary a
#: few hundred thousand tokens), low enough that every figure derived from them is computed in
#: bounded time and memory: a config with ``num_hidden_layers`` of 1e8 is refused at once
#: instead of building a hundred million layer records.
MAX_FIELD = {
    "num_hidden_layers": 10_000, "n_layer": 10_000, "num_layers": 10_000,
    "hidden_size": 1 << 20, "d_model": 1 << 20, "n_embd": 1 << 20,
    "num_attention_heads": 1 << 16, "n_head": 1 << 16,
    "num_key_value_heads": 1 << 16, "num_kv_heads": 1 << 16, "head_dim": 1 << 16,
    "vocab_size": 1 << 26, "intermediate_size": 1 << 24, "ffn_hidden_size": 1 << 24,
    "moe_intermediate_size": 1 << 24, "shared_expert_intermediate_size": 1 << 24,
    "num_experts": 1 << 16, "n_routed_experts": 1 << 16, "num_local_experts": 1 << 16,
    "num_experts_per_tok": 1 << 16, "experts_per_token": 1 << 16,
    "n_shared_experts": 1 << 10, "num_shared_experts": 1 << 10,
    "num_nextn_predict_layers": 1 << 10, "kv_lora_rank": 1 << 16, "q_lora_rank": 1 << 16,
    "qk_rope_head_dim": 1 << 16, "qk_nope_head_dim": 1 << 16, "v_head_dim": 1 << 16,
    "index_head_dim": 1 << 16, "index_n_heads": 1 << 16,
    "linear_num_key_heads": 1 << 16, "linear_num_value_heads": 1 << 16,
    "linear_key_head_dim": 1 << 16, "linear_value_head_dim": 1 << 16,
    "linear_conv_kernel_dim": 1 << 10, "mamba_d_state": 1 << 16, "state_size": 1 << 16,
    "mamba_d_conv": 1 << 10, "conv_kernel": 1 << 10, "mamba_expand": 1 << 8, "expand": 1 << 8,
    "sliding_window": 1 << 40, "max_window_layers": 10_000, "full_attention_interval": 10_000,
    "max_position_embeddings": 1 << 40, "max_sequence_length": 1 << 40, "seq_length": 1 << 40,
    "n_positions": 1 << 40,
    "first_k_dense_replace": 10_000, "moe_layer_freq": 10_000, "decoder_sparse_step": 10_000,
    "depth": 10_000, "patch_size": 1 << 12, "temporal_patch_size": 1 << 8,
    "in_channels": 1 << 12, "in_chans": 1 << 12, "spatial_merge_size": 1 << 8,
    "out_hidden_size": 1 << 20, "embed_dim": 1 << 20,
}

#: Fields the weight estimate reads besides the ones above: booleans, and the integers of the
#: MoE layer pattern and of a vision tower (``vision_config``).
_BOOL_FIELDS = ("attention_bias", "attn_output_gate", "o_proj_bias", "use_qk_norm", "mlp_bias")
_PATTERN_FIELDS = ("first_k_dense_replace", "moe_layer_freq", "decoder_sparse_step")
_VISION_FIELDS = ("hidden_size", "embed_dim", "intermediate_size", "depth", "num_hidden_layers",
                  "patch_size", "temporal_patch_size", "in_channels", "in_chans",
                  "spatial_merge_size", "out_hidden_size")


class _Fields:
    def __init__(self, cfg: dict[str, Any], source: str) -> None:
        self.cfg = cfg
        self.source = source

    def err(self, message: str, hint: str = _HINT) -> ModelConfigError:
        if self.prefix:
            message = message.replace("config.json field '", f"config.json field '{self.prefix}")
        return ModelConfigError(message, source=self.source, hint=hint)

    prefix = ""  # "vision_config." for the fields of a nested object

    def int(self, *keys: str, default: int | None = None, minimum: int = 0) -> int:
        """The first of ``keys`` present (and not null) as an int in ``minimum`` ..
        :data:`MAX_FIELD` (a string, a bool or a fraction is an error naming the field)."""
        for key in keys:
            value = self.cfg.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    value != value or value in (float("inf"), float("-inf")) or \
                    int(value) != value:
                raise self.err(f"config.json field {key!r} must be an integer, got {value!r}"
                               + (" (a string: write the number without quotes)"
                                  if isinstance(value, str) else ""))
            if value < minimum:
                raise self.err(f"config.json field {key!r} must be >= {minimum}, got {value}")
            top = MAX_FIELD.get(key)
            if top is not None and value > top:
                raise self.err(f"config.json field {key!r} is {int(value):,}, more than any "
                               f"model can have (at most {top:,})",
                               hint="check the value: config.json describes the model's "
                                    "architecture")
            return int(value)
        if default is None:
            names = " or ".join(repr(k) for k in keys)
            raise self.err(f"config.json has no field {names}")
        return default

    def bool(self, key: str, default: bool) -> bool:
        """``key`` as a JSON boolean (``"false"`` in quotes is a string, which Python and
        transformers would read as true: an error naming the field)."""
        value = self.cfg.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.err(f"config.json field {key!r} must be true or false, got {value!r}"
                           + (" (a string: write it without quotes)"
                              if isinstance(value, str) else ""))
        return value


def _layer_kinds(f: _Fields, num_layers: int) -> tuple[LayerKind, ...]:
    cfg = f.cfg
    listed = cfg.get("layer_types") or cfg.get("layers_block_type")
    if listed is not None:
        if not isinstance(listed, list) or len(listed) < num_layers:
            raise f.err(f"config.json field 'layer_types' must list one type per layer "
                        f"({num_layers} layers), got {listed!r}")
        kinds = []
        for i, name in enumerate(listed[:num_layers]):
            kind = _LAYER_TYPE_NAMES.get(str(name))
            if kind is None:
                known = ", ".join(sorted(_LAYER_TYPE_NAMES))
                raise f.err(f"config.json 'layer_types[{i}]' is {name!r}, which xllm-vmm does "
                            f"not know", hint=f"known layer types: {known}")
            kinds.append(kind)
        return tuple(kinds)
    interval = cfg.get("full_attention_interval")
    if interval is not None:
        n = f.int("full_attention_interval", minimum=1)
        return tuple(LayerKind.FULL if (i + 1) % n == 0 else LayerKind.LINEAR
                     for i in range(num_layers))
    if cfg.get("kv_lora_rank") is not None:
        return (LayerKind.MLA,) * num_layers
    if cfg.get("sliding_window") is not None and f.bool("use_sliding_window", True):
        first = f.int("max_window_layers", default=0)
        return tuple(LayerKind.SLIDING if i >= first else LayerKind.FULL
                     for i in range(num_layers))
    return (LayerKind.FULL,) * num_layers


def _dtype(f: _Fields) -> tuple[str, str]:
    """(canonical dtype, where it came from)."""
    for key in ("torch_dtype", "dtype"):
        value = f.cfg.get(key)
        if value is None:
            continue
        canon = canonical_dtype(str(value))
        if canon is None:
            raise f.err(f"config.json field {key!r} is {value!r}, not a dtype xllm-vmm knows",
                        hint="use bfloat16, float16 or float32")
        return canon, key
    # No declared dtype (e.g. gpt-oss): unquantized parts of such checkpoints are bf16.
    return "bfloat16", "default (config.json declares no torch_dtype)"


def _check_other_fields(f: _Fields) -> None:
    """The fields the weight estimate reads beyond the architecture's sizes hold what they must
    (so that no later ``int(...)`` or truth test meets a string)."""
    for key in _BOOL_FIELDS:
        f.bool(key, False)
    f.int("first_k_dense_replace", default=0)
    f.int("moe_layer_freq", default=1, minimum=1)
    f.int("decoder_sparse_step", default=1, minimum=1)
    dense = f.cfg.get("mlp_only_layers")
    if dense is not None and not (isinstance(dense, list) and all(
            isinstance(i, int) and not isinstance(i, bool) for i in dense)):
        raise f.err(f"config.json field 'mlp_only_layers' must be a list of layer numbers, got "
                    f"{str(dense)[:40]!r}")
    vc = f.cfg.get("vision_config")
    if isinstance(vc, dict):
        v = _Fields(vc, f.source)
        v.prefix = "vision_config."
        for key in _VISION_FIELDS:
            v.int(key, default=0)


def spec_from_config(cfg: Any, *, name: str, source: str) -> ModelSpec:
    """Build a :class:`ModelSpec` from a parsed ``config.json``.

    ``name`` is what the user called the model (catalogue name or directory); ``source`` is
    where the dict came from, used in error messages. The parameter estimate is filled in by
    :func:`xllm_vmm.models.weight_estimates.with_estimate`.
    """
    if not isinstance(cfg, dict):
        raise ModelConfigError(f"config.json must hold a JSON object, got {type(cfg).__name__}",
                               source=source, hint=_HINT)
    cfg = _text_config(cfg)
    f = _Fields(cfg, source)
    _check_other_fields(f)
    num_layers = f.int("num_hidden_layers", "n_layer", "num_layers", minimum=1)
    hidden = f.int("hidden_size", "d_model", "n_embd", minimum=1)
    heads = f.int("num_attention_heads", "n_head", minimum=1)
    kv_heads = f.int("num_key_value_heads", "num_kv_heads", default=heads, minimum=1)
    if kv_heads > heads or heads % kv_heads:
        raise f.err(f"config.json field 'num_key_value_heads' is {kv_heads}, which does not "
                    f"divide num_attention_heads {heads} (each KV head serves a whole group of "
                    "attention heads)", hint="check num_key_value_heads and num_attention_heads")
    kinds = _layer_kinds(f, num_layers)
    dtype, dtype_from = _dtype(f)

    mla = None
    if LayerKind.MLA in kinds:
        index_dim = f.int("index_head_dim", default=0, minimum=1) or None
        q_lora = cfg.get("q_lora_rank")
        mla = MlaDims(
            kv_lora_rank=f.int("kv_lora_rank", minimum=1),
            qk_rope_head_dim=f.int("qk_rope_head_dim", minimum=1),
            index_head_dim=index_dim,
            q_lora_rank=f.int("q_lora_rank", minimum=1) if q_lora is not None else None,
            qk_nope_head_dim=f.int("qk_nope_head_dim", default=0),
            v_head_dim=f.int("v_head_dim", default=0),
            index_n_heads=f.int("index_n_heads", default=0),
        )
        head_dim = mla.qk_rope_head_dim + (mla.qk_nope_head_dim or 0)
    else:
        if cfg.get("head_dim") is None and hidden % heads:
            raise f.err(f"config.json has no 'head_dim' and hidden_size {hidden} is not a "
                        f"multiple of num_attention_heads {heads}",
                        hint="add 'head_dim' to config.json")
        head_dim = f.int("head_dim", default=hidden // heads, minimum=1)

    linear = None
    if LayerKind.LINEAR in kinds:
        nk = f.int("linear_num_key_heads", minimum=1)
        nv = f.int("linear_num_value_heads", minimum=1)
        dk = f.int("linear_key_head_dim", minimum=1)
        dv = f.int("linear_value_head_dim", minimum=1)
        kernel = f.int("linear_conv_kernel_dim", minimum=1)
        linear = LinearStateDims(
            recurrent_elems=nv * dk * dv,
            conv_elems=(2 * nk * dk + nv * dv) * (kernel - 1),
            num_key_heads=nk, num_value_heads=nv, key_head_dim=dk, value_head_dim=dv,
            conv_kernel=kernel,
        )
    elif LayerKind.MAMBA in kinds:
        d_state = f.int("mamba_d_state", "state_size", minimum=1)
        d_conv = f.int("mamba_d_conv", "conv_kernel", minimum=1)
        expand = f.int("mamba_expand", "expand", minimum=1)
        inner = expand * hidden
        linear = LinearStateDims(recurrent_elems=inner * d_state, conv_elems=inner * (d_conv - 1),
                                 conv_kernel=d_conv)

    sliding = None
    if LayerKind.SLIDING in kinds:
        sliding = f.int("sliding_window", minimum=1)

    quant = cfg.get("quantization_config")
    quant_method = None
    if isinstance(quant, dict):
        quant_method = str(quant.get("quant_method") or "") or None

    arch = cfg.get("architectures") or [""]
    experts = f.int("num_experts", "n_routed_experts", "num_local_experts", default=0)
    shared = f.int("n_shared_experts", "num_shared_experts", default=0)
    if not shared and f.int("shared_expert_intermediate_size", default=0):
        shared = 1
    return ModelSpec(
        name=name,
        architecture=str(arch[0]) if isinstance(arch, list) and arch else "",
        model_type=str(cfg.get("model_type") or ""),
        num_layers=num_layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        layer_kinds=kinds,
        dtype=dtype,
        max_position_embeddings=f.int("max_position_embeddings", "max_sequence_length",
                                      "seq_length", "n_positions", default=0, minimum=1),
        vocab_size=f.int("vocab_size", default=0, minimum=1),
        intermediate_size=f.int("intermediate_size", "ffn_hidden_size", default=0, minimum=1),
        sliding_window=sliding,
        mla=mla,
        linear_state=linear,
        vision=isinstance(cfg.get("vision_config"), dict),
        mtp_layers=f.int("num_nextn_predict_layers", default=0),
        tie_word_embeddings=f.bool("tie_word_embeddings", False),
        num_experts=experts,
        num_experts_per_tok=f.int("num_experts_per_tok", "experts_per_token", default=0),
        moe_intermediate_size=f.int("moe_intermediate_size", default=0, minimum=1),
        num_shared_experts=shared,
        quantization=quant_method,
        extra={"config": cfg, "dtype_from": dtype_from},
        source=source,
    )
