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


class _Fields:
    def __init__(self, cfg: dict[str, Any], source: str) -> None:
        self.cfg = cfg
        self.source = source

    def err(self, message: str, hint: str = _HINT) -> ModelConfigError:
        return ModelConfigError(message, source=self.source, hint=hint)

    def int(self, *keys: str, default: int | None = None, minimum: int = 0) -> int:
        """The first of ``keys`` present (and not null) as an int >= ``minimum``."""
        for key in keys:
            value = self.cfg.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
                raise self.err(f"config.json field {key!r} must be an integer, got {value!r}")
            if value < minimum:
                raise self.err(f"config.json field {key!r} must be >= {minimum}, got {value}")
            return int(value)
        if default is None:
            names = " or ".join(repr(k) for k in keys)
            raise self.err(f"config.json has no field {names}")
        return default


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
    if cfg.get("sliding_window") is not None and cfg.get("use_sliding_window", True) is not False:
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


def spec_from_config(cfg: Any, *, name: str, source: str) -> ModelSpec:
    """Build a :class:`ModelSpec` from a parsed ``config.json``.

    ``name`` is what the user called the model (catalogue name or directory); ``source`` is
    where the dict came from, used in error messages. The parameter estimate is filled in by
    :func:`xllm_vmm.models.weights.with_estimate`.
    """
    if not isinstance(cfg, dict):
        raise ModelConfigError(f"config.json must hold a JSON object, got {type(cfg).__name__}",
                               source=source, hint=_HINT)
    cfg = _text_config(cfg)
    f = _Fields(cfg, source)
    num_layers = f.int("num_hidden_layers", "n_layer", "num_layers", minimum=1)
    hidden = f.int("hidden_size", "d_model", "n_embd", minimum=1)
    heads = f.int("num_attention_heads", "n_head", minimum=1)
    kv_heads = f.int("num_key_value_heads", "num_kv_heads", default=heads, minimum=1)
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
                                      "seq_length", "n_positions", default=0),
        vocab_size=f.int("vocab_size", default=0),
        intermediate_size=f.int("intermediate_size", "ffn_hidden_size", default=0),
        sliding_window=sliding,
        mla=mla,
        linear_state=linear,
        vision=isinstance(cfg.get("vision_config"), dict),
        mtp_layers=f.int("num_nextn_predict_layers", default=0),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        num_experts=experts,
        num_experts_per_tok=f.int("num_experts_per_tok", "experts_per_token", default=0),
        moe_intermediate_size=f.int("moe_intermediate_size", default=0),
        num_shared_experts=shared,
        quantization=quant_method,
        extra={"config": cfg, "dtype_from": dtype_from},
        source=source,
    )
