"""``cache_layout``: what one of N tensor-parallel workers caches for a model.

Groups, in this order (a group is present only when the model has such layers):

- ``"attn"``: K and V of every full-attention layer; ``kv_heads / workers`` heads per worker,
  or one head (replicated ``workers / kv_heads`` times) when workers exceed KV heads. Width per
  tensor: ``heads_per_worker x head_dim x kv_elem`` bytes per token.
- ``"sliding"``: K and V of every sliding-window layer, same width as ``"attn"``, capped at
  ``sliding_window`` tokens per sequence (``max_tokens_per_seq``).
- ``"mla"``: one latent tensor per MLA layer, ``(kv_lora_rank + qk_rope_head_dim) x kv_elem``
  bytes per token, replicated on every worker (MLA has no KV heads to split).
- ``"index"``: one index-key tensor per MLA layer of an MLA+INDEX model (DeepSeek-V3.2),
  ``index_head_dim x kv_elem`` bytes per token, replicated.
- ``"draft"`` (only with ``draft=True`` and MTP layers, SD-01): the MTP layers' cache with their
  own width (latent for MLA models, K/V heads per worker otherwise); ``"draft_index"`` beside it
  for an MLA+INDEX model's MTP layers. With a separate draft model (``draft_spec``, read from
  its own ``config.json``) the draft groups are that model's own layout instead
  (``draft``, ``draft_index``, ``draft_sliding``).

Hybrid models (HY-01): linear-attention / SSM layers are not a group; their conv and recurrent
state is :class:`ResidentState`, in bytes per sequence slot per worker, at ``state_dtype``
(default: the model's dtype). Gated delta-net heads are split across workers like KV heads.

``kv_elem`` is the element size of ``kv_dtype``: ``auto`` follows the model's dtype.
"""

from __future__ import annotations

from xllm_vmm.models.dtypes import dtype_bytes, resolve_kv_dtype
from xllm_vmm.models.errors import LayoutError
from xllm_vmm.models.spec import (CacheGroup, CacheLayout, CacheTensor, LayerKind, MlaDims,
                                  ModelSpec, ResidentState)


def kv_heads_per_worker(spec: ModelSpec, workers: int) -> int:
    """KV heads one worker caches: ``kv_heads / workers`` when workers divide the KV heads,
    1 (replicated) when workers are a multiple of the KV heads. Anything else is a
    :class:`LayoutError`."""
    kv = spec.num_kv_heads
    if workers <= kv:
        if kv % workers:
            raise LayoutError(
                f"{workers} workers cannot split the {kv} KV heads of {spec.name}",
                hint=f"use a worker count (nnodes x devices / dp_size) that divides {kv} or is a "
                     f"multiple of it")
        return kv // workers
    if workers % kv:
        raise LayoutError(
            f"{workers} workers cannot replicate the {kv} KV heads of {spec.name} evenly",
            hint=f"use a worker count (nnodes x devices / dp_size) that is a multiple of {kv}")
    return 1


def _kv_tensors(prefix: str, layers: list[int], width: int) -> tuple[CacheTensor, ...]:
    out: list[CacheTensor] = []
    for i in layers:
        out.append(CacheTensor(f"{prefix}{i}.k", width))
        out.append(CacheTensor(f"{prefix}{i}.v", width))
    return tuple(out)


def _mla_groups(names: tuple[str, str], prefix: str, layers: list[int], m: MlaDims, elem: int,
                block_size: int) -> list[CacheGroup]:
    """The latent group (one tensor per layer) and, for MLA+INDEX, the index-key group."""
    groups = [CacheGroup(names[0], tuple(CacheTensor(f"{prefix}{i}.latent", m.latent_elems * elem)
                                         for i in layers), block_size)]
    if m.index_head_dim:
        groups.append(CacheGroup(names[1], tuple(
            CacheTensor(f"{prefix}{i}.index", m.index_head_dim * elem) for i in layers),
            block_size))
    return groups


#: Group names of a separate draft model's cache (``draft_spec``), by the draft's own group.
_DRAFT_NAMES = {"attn": "draft", "mla": "draft", "index": "draft_index",
                "sliding": "draft_sliding"}


def _draft_from_spec(draft: ModelSpec, workers: int, block_size: int,
                     kv_dtype: str) -> tuple[list[CacheGroup], ResidentState | None]:
    """A separate draft model's cache: its own layout, groups renamed ``draft*`` and tensors
    prefixed ``draft.``."""
    own = cache_layout(draft, workers=workers, block_size=block_size, kv_dtype=kv_dtype)
    groups = [CacheGroup(_DRAFT_NAMES[g.name],
                         tuple(CacheTensor(f"draft.{t.name}", t.bytes_per_token)
                               for t in g.tensors),
                         g.block_size, g.max_tokens_per_seq) for g in own.groups]
    return groups, own.resident


def cache_layout(spec: ModelSpec, workers: int = 1, block_size: int = 128,
                 kv_dtype: str = "auto", draft: bool = False,
                 state_dtype: str | None = None,
                 draft_spec: ModelSpec | None = None) -> CacheLayout:
    """The per-worker :class:`CacheLayout` of ``spec`` for ``workers`` tensor-parallel workers.

    Tensor parallelism splits the attention heads, so ``workers`` must divide
    ``num_attention_heads``. ``block_size`` is in tokens; ``kv_dtype`` is the ``kv_cache_dtype``
    flag (``auto``, ``bfloat16``, ``float16``, ``float32``, ``int8``, ``fp8``, ...); ``draft`` adds the MTP
    draft group(s) (SD-01) when the model has MTP layers. ``draft_spec`` (a separate draft
    model read from its own ``config.json``) replaces that estimate: the draft groups are then the
    draft model's own layout (``draft``, ``draft_index``, ``draft_sliding``; its resident state,
    if any, is added to the target's). Raises :class:`LayoutError` for a worker count that cannot
    split the heads, a non-positive block size or an unknown dtype.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise LayoutError(f"workers must be a positive integer, got {workers!r}",
                          hint="set nnodes (and devices) to 1 or more")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise LayoutError(f"block_size must be a positive number of tokens, got {block_size!r}",
                          hint="set --block_size to a positive integer (default 128)")
    elem = dtype_bytes(resolve_kv_dtype(kv_dtype, spec.dtype), what="kv_cache_dtype")
    if spec.num_attention_heads % workers:
        raise LayoutError(
            f"{workers} workers cannot split the {spec.num_attention_heads} attention heads of "
            f"{spec.name}",
            hint=f"use a worker count (nnodes x devices / dp_size) that divides {spec.num_attention_heads}")

    full = [i for i, k in enumerate(spec.layer_kinds) if k == LayerKind.FULL]
    sliding = [i for i, k in enumerate(spec.layer_kinds) if k == LayerKind.SLIDING]
    mla = [i for i, k in enumerate(spec.layer_kinds) if k == LayerKind.MLA]
    mtp = draft and draft_spec is None and spec.mtp_layers > 0
    groups: list[CacheGroup] = []

    kv_width = 0
    if full or sliding or (mtp and spec.mla is None):
        kv_width = kv_heads_per_worker(spec, workers) * spec.head_dim * elem
    if full:
        groups.append(CacheGroup("attn", _kv_tensors("layer", full, kv_width), block_size))
    if sliding:
        groups.append(CacheGroup("sliding", _kv_tensors("layer", sliding, kv_width), block_size,
                                 max_tokens_per_seq=spec.sliding_window))
    if mla:
        assert spec.mla is not None
        groups += _mla_groups(("mla", "index"), "layer", mla, spec.mla, elem, block_size)
    if mtp:
        layers = list(range(spec.mtp_layers))
        if spec.mla is not None:
            groups += _mla_groups(("draft", "draft_index"), "mtp", layers, spec.mla, elem,
                                  block_size)
        else:
            groups.append(CacheGroup("draft", _kv_tensors("mtp", layers, kv_width), block_size))

    resident = None
    n_state = spec.count(LayerKind.LINEAR) + spec.count(LayerKind.MAMBA)
    if n_state and spec.linear_state is not None:
        ls = spec.linear_state
        if workers > 1 and ls.num_key_heads and (
                ls.num_key_heads % workers or ls.num_value_heads % workers):
            raise LayoutError(
                f"{workers} workers cannot split the linear-attention heads of {spec.name} "
                f"({ls.num_key_heads} key heads, {ls.num_value_heads} value heads)",
                hint="use a worker count (nnodes x devices / dp_size) that divides both")
        dims = ls.per_worker(workers)
        s_elem = dtype_bytes(state_dtype or spec.dtype, what="state dtype")
        resident = ResidentState(conv_bytes_per_seq=n_state * dims.conv_elems * s_elem,
                                 recurrent_bytes_per_seq=n_state * dims.recurrent_elems * s_elem)
    if draft and draft_spec is not None:
        draft_groups, draft_resident = _draft_from_spec(draft_spec, workers, block_size,
                                                        kv_dtype)
        groups += draft_groups
        if draft_resident is not None:
            resident = draft_resident if resident is None else ResidentState(
                resident.conv_bytes_per_seq + draft_resident.conv_bytes_per_seq,
                resident.recurrent_bytes_per_seq + draft_resident.recurrent_bytes_per_seq)
    return CacheLayout(model=spec.name, workers=workers, groups=tuple(groups), resident=resident)
