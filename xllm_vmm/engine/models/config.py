"""The model fields the engine's families read from a Hugging Face ``config.json``.

The cache *layout* comes from :mod:`xllm_vmm.models` (so ``plan``'s figures and the running
cache agree); this module reads the compute-side fields the layout does not carry (rope,
norm epsilon, MoE routing) into one frozen :class:`ModelConfig`. A missing or malformed field is
a :class:`ModelConfigError` naming the field and the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from xllm_vmm.engine.layers.rotary import rope_parameters
from xllm_vmm.models.errors import ModelConfigError


@dataclass(frozen=True)
class ModelConfig:
    """Compute-side settings of one decoder-only model (units: elements / tokens)."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: dict = field(default_factory=dict)
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    dtype: str = "float32"
    # mixture of experts (0 experts: dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    sliding_window: int | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def is_sparse_layer(self, i: int) -> bool:
        """Layer ``i`` uses the MoE block (Qwen3-MoE's rule)."""
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % max(1, self.decoder_sparse_step) == 0)

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
        def need(name: str, kind=int):
            if name not in cfg or cfg[name] is None:
                raise ModelConfigError(f"config.json has no field {name!r}", source=source)
            value = cfg[name]
            if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
                raise ModelConfigError(f"{name!r} must be an integer, got {value!r}",
                                       source=source)
            return kind(value)

        archs = cfg.get("architectures") or []
        if not archs:
            raise ModelConfigError("config.json has no 'architectures' list", source=source)
        heads = need("num_attention_heads")
        hidden = need("hidden_size")
        head_dim = cfg.get("head_dim") or hidden // heads
        use_sw = cfg.get("use_sliding_window", False)
        return cls(
            architecture=archs[0], model_type=str(cfg.get("model_type", "")),
            vocab_size=need("vocab_size"), hidden_size=hidden,
            num_layers=need("num_hidden_layers"), num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=int(head_dim),
            intermediate_size=need("intermediate_size"),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 4096),
            rope=rope_parameters(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            hidden_act=str(cfg.get("hidden_act", "silu")),
            dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
            num_experts=int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0),
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
            sliding_window=cfg.get("sliding_window") if use_sw else None,
            raw=dict(cfg),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ModelConfigError(f"cannot read config.json: {e.strerror or e}",
                                   source=str(path)) from None
        try:
            cfg = json.loads(text)
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"config.json is not valid JSON (line {e.lineno} column {e.colno})",
                                   source=str(path)) from None
        return cls.from_dict(cfg, str(path))
