"""An MTP (multi-token prediction) draft module, DeepSeek-V3's shape, from a draft directory.

Draft directory (what xllm's ``tools/export_mtp.py`` writes for ``deepseek_v3``): the
target's ``config.json`` with ``num_hidden_layers`` = ``num_nextn_predict_layers`` = the MTP
layer count, ``architectures: ["DeepseekMTPForCausalLM"]``, ``model_type: "deepseek_v3_mtp"``,
``first_k_dense_replace: 0``; tensors (``mtp_layer_parameters.safetensors`` with a
``model.safetensors.index.json``) renamed from the target's ``model.layers.{N}.``:
``model.embed_tokens``, ``model.enorm``, ``model.hnorm``, ``model.eh_proj``,
``model.shared_head.norm``, ``model.shared_head.head`` and the decoder layer under
``model.layers.0.`` (MLA attention + MoE, the target's own layer shape). The tokenizer files
are copied.

Per token at position ``i`` (the target's hidden state ``h_i`` and the *next* token
``x_{i+1}``): ``e = enorm(embed(x_{i+1}))``, ``g = hnorm(h_i)``,
``y = layer0(eh_proj([e, g]))`` (one decoder layer over the draft's own latent cache, group
``"draft"``, tensor ``draft.layer0.latent``), logits ``= head(norm(y))`` predict ``x_{i+2}``.
For the k-th proposal (k >= 2) ``h`` is the draft's own previous output ``y``.

Only the first MTP layer is used (``num_speculative_tokens`` proposals reuse it, as the
engine's MTP does with one exported layer).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from xllm_vmm.engine.layers.linear import ReplicatedLinear
from xllm_vmm.engine.layers.norm import RMSNorm
from xllm_vmm.models.errors import ModelConfigError

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

    from xllm_vmm.engine.step import StepInput

MTP_ARCHITECTURES = ("DeepseekMTPForCausalLM",)
DRAFT_GROUP = "draft"


class MtpDraft:
    """The draft module (see the module docstring) over ``kv_cache``'s ``"draft"`` group."""

    def __init__(self, cfg: Any, weights: Mapping[str, Tensor], kv_cache: Any, *,
                 device: Any = "cpu") -> None:
        from xllm_vmm.engine.models.deepseek_v3 import DeepseekV3ForCausalLM
        from xllm_vmm.engine.models.decoder import WeightsMismatch

        if cfg.architecture not in MTP_ARCHITECTURES:
            raise ModelConfigError(
                f"draft architecture {cfg.architecture!r} is not an MTP module",
                hint=f"export the draft with xllm's tools/export_mtp.py (architectures: "
                     f"{', '.join(MTP_ARCHITECTURES)})")
        need = ("model.enorm.weight", "model.hnorm.weight", "model.eh_proj.weight",
                "model.shared_head.norm.weight", "model.shared_head.head.weight")
        missing = [n for n in need if n not in weights]
        if missing:
            raise WeightsMismatch(f"the draft checkpoint has no tensor {missing[0]!r}, which an "
                                  "MTP module needs (is it an export_mtp.py directory?)")
        # the decoder layer, the embedding and the head are a one-layer DeepSeek-V3 whose final
        # norm and head are the MTP's shared head
        view = dict(weights)
        view["model.norm.weight"] = weights["model.shared_head.norm.weight"]
        view["lm_head.weight"] = weights["model.shared_head.head.weight"]
        import dataclasses

        body_cfg = dataclasses.replace(cfg, architecture="DeepseekV3ForCausalLM", num_layers=1)
        self.body = DeepseekV3ForCausalLM(body_cfg, view, device=device)
        hid = cfg.hidden_size
        self.config = self.body.config
        self.enorm = RMSNorm(weights["model.enorm.weight"], cfg.rms_norm_eps)
        self.hnorm = RMSNorm(weights["model.hnorm.weight"], cfg.rms_norm_eps)
        eh = weights["model.eh_proj.weight"]
        if tuple(eh.shape) != (hid, 2 * hid):
            raise WeightsMismatch(f"tensor 'model.eh_proj.weight' has shape {tuple(eh.shape)}, "
                                  f"config.json implies {(hid, 2 * hid)}")
        self.eh_proj = ReplicatedLinear(eh)
        self.unused_weights = sorted(set(self.body.unused_weights) - set(need))
        self.views, self.backend = self._make_kv(kv_cache, device)
        self.device = device

    def _make_kv(self, kv_cache: Any, device: Any):
        from xllm_vmm.engine.attention.mla import LatentCacheViews, MLATorchBackend

        b = self.body
        dim = b.kv_lora_rank + b.qk_rope_head_dim
        views = LatentCacheViews(kv_cache, num_layers=1, latent_dim=dim,
                                 compute_dtype=b.dtype, group=DRAFT_GROUP, prefix="draft.layer")
        backend = MLATorchBackend(views.geometry, num_heads=b.num_heads, latent_dim=dim,
                                  value_dim=b.kv_lora_rank, scale=b.softmax_scale, device=device)
        return views, backend

    @classmethod
    def load(cls, draft_dir: str | Path, kv_cache: Any, *, dtype: Any = None,
             device: Any = "cpu", weights: Mapping[str, Any] | None = None) -> MtpDraft:
        """Read ``draft_dir`` (config + tensors; ``weights`` when already loaded)."""
        from xllm_vmm.engine.models.config import ModelConfig
        from xllm_vmm.engine.worker import load_model_weights

        cfg = ModelConfig.from_dir(draft_dir)
        if weights is None:
            weights = load_model_weights(draft_dir, dtype=dtype, device=device)
        return cls(cfg, weights, kv_cache, device=device)

    @property
    def block_size(self) -> int:
        return self.views.geometry.block_size

    def forward(self, step: StepInput, prev_hidden: Tensor) -> tuple[Tensor, Tensor]:
        """Run the draft on ``step`` (tokens = the *next* tokens, positions = the hidden
        states' positions; the ``"draft"`` group's block tables) with ``prev_hidden``
        ``(T, hidden)``. Returns ``(logits (num_sampled, V) float32, hidden (num_sampled,
        hidden) pre-norm)`` of the sampled rows; the new latents are in the draft cache."""
        import torch

        b = self.body
        with torch.inference_mode():
            meta = self.backend.prepare(step)
            ids = step.input_ids.to(self.device)
            pos = step.positions.to(self.device)
            e = self.enorm(b.embed(ids))
            g = self.hnorm(prev_hidden.to(e.dtype))
            x = self.eh_proj(torch.cat((e, g), dim=-1))
            x = b.layers[0](x, pos, self.views.layers[0], self.backend, meta)
            rows = step.sample_indices.to(self.device)
            y = x[rows]
            return b.logits(b.final_hidden(y)), y

    def close(self) -> None:
        self.views.close()
        self.body = None


__all__ = ["DRAFT_GROUP", "MTP_ARCHITECTURES", "MtpDraft"]
