"""Model specifications and per-worker cache layouts.

A :class:`ModelSpec` is what xllm-vmm knows about a model from its ``config.json`` (and, when
present, its safetensors headers). A :class:`CacheLayout` is what one worker must cache for it:
cache groups of tensors over the VMM arena, plus resident per-sequence state.

Units: bytes, tokens, layers. Nothing here imports torch.

Shape of a layout (the contract the planner, the config rules and the KV cache all share):

- A :class:`CacheGroup` is a set of tensors with one block layout: every tensor of a group has
  the same bytes per token, so a block id means the same token range in each of them and a
  *slot* (one page offset across every tensor of the group) holds the same number of blocks in
  each tensor. Different widths make different groups: full-attention K/V (``"attn"``), MLA
  latent (``"mla"``), the MLA index cache (``"index"``), sliding-window layers (``"sliding"``,
  capped per sequence), the MTP draft (``"draft"``, SD-01).
- Conv / recurrent state of hybrid models is *not* a group: it is :class:`ResidentState`,
  reserved per sequence slot outside the page pool (HY-01).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class LayerKind(str, enum.Enum):
    FULL = "full_attention"  # MHA / GQA / MQA with a per-token K and V
    SLIDING = "sliding_attention"  # like FULL, cache capped at the window
    MLA = "mla"  # DeepSeek multi-head latent attention (latent + rope key per token)
    LINEAR = "linear_attention"  # gated delta-net / linear attention: fixed state per sequence
    MAMBA = "mamba"  # SSM: conv + recurrent state per sequence


@dataclass(frozen=True)
class MlaDims:
    kv_lora_rank: int
    qk_rope_head_dim: int
    index_head_dim: int | None = None  # DeepSeek-V3.2 style index cache ("MLA+INDEX")
    # Projection shapes, used for the parameter estimate only (0 / None when absent).
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    index_n_heads: int = 0

    @property
    def latent_elems(self) -> int:
        """Elements cached per token per MLA layer: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class LinearStateDims:
    """Per-layer, per-sequence state of a linear-attention / SSM layer, in elements."""

    recurrent_elems: int
    conv_elems: int
    # Head structure (gated delta-net style), used to split the state across workers; 0 = unknown
    # (the state is then replicated on every worker).
    num_key_heads: int = 0
    num_value_heads: int = 0
    key_head_dim: int = 0
    value_head_dim: int = 0
    conv_kernel: int = 0

    def per_worker(self, workers: int) -> "LinearStateDims":
        """The state one of ``workers`` tensor-parallel workers holds: key and value heads are
        split across workers (``recurrent = (nv/w) * dk * dv``,
        ``conv = (2 * (nk/w) * dk + (nv/w) * dv) * (kernel - 1)``). Without a head structure, or
        when ``workers`` does not divide both head counts, the whole state is returned (replicated);
        the caller decides whether that is an error."""
        nk, nv = self.num_key_heads, self.num_value_heads
        if workers <= 1 or nk <= 0 or nv <= 0 or nk % workers or nv % workers:
            return self
        nk_w, nv_w = nk // workers, nv // workers
        return LinearStateDims(
            recurrent_elems=nv_w * self.key_head_dim * self.value_head_dim,
            conv_elems=(2 * nk_w * self.key_head_dim + nv_w * self.value_head_dim)
            * max(self.conv_kernel - 1, 0),
            num_key_heads=nk_w,
            num_value_heads=nv_w,
            key_head_dim=self.key_head_dim,
            value_head_dim=self.value_head_dim,
            conv_kernel=self.conv_kernel,
        )


@dataclass(frozen=True)
class ModelSpec:
    name: str  # catalogue name or directory
    architecture: str  # config["architectures"][0], "" if absent
    model_type: str
    num_layers: int  # num_hidden_layers (MTP layers not included)
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    layer_kinds: tuple[LayerKind, ...]  # one per layer, len == num_layers
    dtype: str  # "bfloat16", "float16", "float32", ...
    max_position_embeddings: int
    vocab_size: int = 0
    intermediate_size: int = 0
    sliding_window: int | None = None
    mla: MlaDims | None = None
    linear_state: LinearStateDims | None = None
    vision: bool = False  # has a vision tower -> backend "vlm"
    mtp_layers: int = 0  # num_nextn_predict_layers
    tie_word_embeddings: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    weight_bytes: int | None = None  # exact, from safetensors headers, when known
    quantization: str | None = None  # quant_method from quantization_config, if any
    extra: dict = field(default_factory=dict, compare=False, hash=False)
    # Added by the model reader (xllm_vmm.models.weight_estimates): the architecture's estimate.
    param_count: int = 0  # parameters of the served model (MTP layers excluded, vision included)
    estimated_weight_bytes: int = 0  # bytes of those parameters at their stored dtypes
    mtp_param_count: int = 0  # parameters of the MTP layers (loaded with an MTP draft)
    mtp_weight_bytes: int = 0
    source: str = ""  # "catalogue" or the path of the config.json read

    @property
    def served_weight_bytes(self) -> int:
        """Weight bytes the engine loads: exact (safetensors headers) when known, else the
        estimate from the architecture."""
        return self.weight_bytes if self.weight_bytes is not None else self.estimated_weight_bytes

    @property
    def weight_dtype(self) -> str:
        """The dtype the checkpoint stores its weights in: the quantization method when it has
        one (``FP8`` for DeepSeek-V3, ``MXFP4`` for gpt-oss: their large matrices; norms and
        embeddings stay in :attr:`dtype`), else :attr:`dtype`."""
        if self.quantization:
            return self.quantization.upper()
        return self.dtype

    @property
    def weight_bytes_exact(self) -> bool:
        return self.weight_bytes is not None

    @property
    def weights_warning(self) -> str | None:
        """Why the safetensors headers were not used (the file and what is wrong with it), or
        None. The weight bytes are then the architecture's estimate."""
        err = self.extra.get("safetensors_error")
        return None if err is None else str(err)

    def count(self, kind: "LayerKind") -> int:
        """Number of layers of ``kind`` (MTP layers not included)."""
        return sum(1 for k in self.layer_kinds if k == kind)

    @property
    def is_hybrid(self) -> bool:
        return any(k in (LayerKind.LINEAR, LayerKind.MAMBA) for k in self.layer_kinds)

    @property
    def has_grouped_caches(self) -> bool:
        """More than one kind of attention cache (e.g. sliding + full)."""
        kinds = {k for k in self.layer_kinds if k not in (LayerKind.LINEAR, LayerKind.MAMBA)}
        return len(kinds) > 1

    @property
    def backend(self) -> str:
        """The engine backend this model needs: ``"vlm"`` with a vision tower, else ``"llm"``."""
        return "vlm" if self.vision else "llm"


@dataclass(frozen=True)
class CacheTensor:
    name: str  # e.g. "layer3.k", "layer3.v", "layer3.latent", "layer3.index", "mtp0.k"
    bytes_per_token: int


@dataclass(frozen=True)
class CacheGroup:
    """Tensors that share one block layout (same bytes per token in each tensor)."""

    name: str  # "attn", "mla", "index", "sliding", "draft"
    tensors: tuple[CacheTensor, ...]
    block_size: int  # tokens per block
    max_tokens_per_seq: int | None = None  # sliding window cap; None = grows with the context

    @property
    def tensor_bytes_per_token(self) -> int:
        return self.tensors[0].bytes_per_token

    @property
    def bytes_per_token(self) -> int:
        """All tensors of the group together."""
        return sum(t.bytes_per_token for t in self.tensors)

    @property
    def tensor_block_bytes(self) -> int:
        """Bytes of one block in one tensor."""
        return self.tensor_bytes_per_token * self.block_size

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across every tensor of the group."""
        return self.bytes_per_token * self.block_size

    def blocks_per_page(self, page_bytes: int) -> int:
        """Blocks that fit in one page of one tensor; a block never straddles a page."""
        return page_bytes // self.tensor_block_bytes

    def slot_bytes(self, page_bytes: int) -> int:
        """One slot = one page in every tensor of the group."""
        return page_bytes * len(self.tensors)


@dataclass(frozen=True)
class ResidentState:
    """Per-sequence state kept outside the page pool (HY-01), in bytes per sequence slot."""

    conv_bytes_per_seq: int
    recurrent_bytes_per_seq: int

    @property
    def bytes_per_seq(self) -> int:
        return self.conv_bytes_per_seq + self.recurrent_bytes_per_seq


@dataclass(frozen=True)
class CacheLayout:
    """What one worker (of ``workers``) caches for a model."""

    model: str
    workers: int
    groups: tuple[CacheGroup, ...]
    resident: ResidentState | None = None

    @property
    def bytes_per_token(self) -> int:
        return sum(g.bytes_per_token for g in self.groups if g.max_tokens_per_seq is None)

    def least_pool_bytes(self, page_bytes: int) -> int:
        """The least a VMM pool can map for this layout, in bytes: one slot of every group (one
        page in each VMM tensor)."""
        return sum(g.slot_bytes(page_bytes) for g in self.groups)

    def least_quota_bytes(self, page_bytes: int, shared_weights_bytes: int = 0) -> int:
        """EL-06, the one home of its formula (``check-config`` and ``plan`` call it): the least
        ``max_cache_size`` that lets the pool map anything, :meth:`least_pool_bytes` plus the
        weights per worker when they share the pool (VMM-02)."""
        return self.least_pool_bytes(page_bytes) + shared_weights_bytes

    def group(self, name: str) -> CacheGroup:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(name)
