"""What each tensor-parallel worker loads of a checkpoint: the one home of the split rules.

:func:`shard_hook` answers :func:`xllm_vmm.weights.load_weights`'s ``shard(name, shape)`` so a
worker reads only its part of every tensor (Hugging Face names). ``W`` workers, ``ep``
expert-parallel groups (``ep_size``), ``W / ep`` workers in each:

| tensor | split |
|---|---|
| ``model.embed_tokens.weight``, ``lm_head.weight`` | rows (vocabulary): ``ceil(vocab / W)`` each, the last rank the rest (:func:`~xllm_vmm.engine.distributed.vocab.vocab_range`) |
| ``*.self_attn.{q_proj,q_b_proj}.{weight,bias}`` | rows: ``heads / W`` attention heads (× ``head_dim``; MLA: × ``qk_nope + qk_rope``) |
| ``*.self_attn.{k,v}_proj.{weight,bias}`` | rows: ``kv_heads / W`` KV heads; when ``W > kv_heads`` one head, rank ``r`` holding head ``r // (W / kv_heads)`` (replicated, as :func:`xllm_vmm.models.layout.kv_heads_per_worker` counts it) |
| ``*.self_attn.kv_b_proj.weight`` (MLA) | rows: the same heads (× ``qk_nope + v_head_dim``) |
| ``*.self_attn.o_proj.weight`` | columns: the same heads (× ``head_dim``; MLA: × ``v_head_dim``) |
| ``*.mlp.{gate,up}_proj``, ``*.mlp.shared_expert(s).{gate,up}_proj`` | rows: ``intermediate / W`` |
| ``*.mlp.down_proj``, ``*.mlp.shared_expert(s).down_proj`` | columns: ``intermediate / W`` |
| Gated DeltaNet (Qwen3-Next) ``*.linear_attn.{in_proj_qkvz,in_proj_ba}.weight`` | rows: ``linear_num_key_heads / W`` key heads (each with its value heads; the projections are grouped per key head) |
| ``*.linear_attn.{dt_bias,A_log}`` | ``linear_num_value_heads / W`` value heads |
| ``*.linear_attn.out_proj.weight`` | columns: the same value heads |
| ``*.linear_attn.conv1d.weight`` | whole (its channels are ``[q, k, v]`` of every head: the layer takes this rank's three channel ranges, a small copy) |
| ``*.mlp.experts.J.*`` | expert ``J`` is held by the ``W / ep`` workers of expert group ``J // (E / ep)`` only (:func:`expert_range`; the others skip it: ``ShardSpec.skip()``), its intermediate features split ``W / ep`` ways among them (:func:`expert_split`) |
| everything else (norms, q/k norms, MLA's ``q_a_proj``/``kv_a_proj_with_mqa`` and their norms — the latent is replicated —, the MoE router and its bias, DeepSeek-V3.2's indexer, ``o_proj``/``down_proj`` biases) | whole |

With ``ep = 1`` every worker holds every expert's ``1 / W`` slice; with ``ep = W`` whole
experts, ``E / W`` each. Either way each (expert, intermediate slice) pair lives on exactly one
worker, so the layer's one all-reduce sums every expert's contribution once.

The layers (``xllm_vmm.engine.layers``) are told through ``TensorParallel.shard_hook`` that their
tensors are already this rank's part; a row-parallel bias is added once after the all-reduce.
:func:`check_divisible` states what ``W`` (and ``ep``) must divide, with the model's numbers,
before anything is loaded.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # pragma: no cover
    from xllm_vmm.engine.models.config import ModelConfig
    from xllm_vmm.weights import ShardSpec

_RULES = (
    (re.compile(r"^(model\.embed_tokens|lm_head)\.weight$"), "vocab"),
    (re.compile(r"\.self_attn\.(q_proj|q_b_proj)\.(weight|bias)$"), "heads_rows"),
    (re.compile(r"\.self_attn\.[kv]_proj\.(weight|bias)$"), "kv"),
    (re.compile(r"\.self_attn\.kv_b_proj\.weight$"), "heads_rows"),
    (re.compile(r"\.self_attn\.o_proj\.weight$"), "heads_cols"),
    (re.compile(r"\.mlp\.experts\.\d+\.(gate|up)_proj\.(weight|bias)$"), "expert_in"),
    (re.compile(r"\.mlp\.experts\.\d+\.down_proj\.weight$"), "expert_out"),
    (re.compile(r"\.mlp\.(shared_experts?\.)?(gate|up)_proj\.(weight|bias)$"), "ffn_in"),
    (re.compile(r"\.mlp\.(shared_experts?\.)?down_proj\.weight$"), "ffn_out"),
    (re.compile(r"\.linear_attn\.(in_proj_qkvz|in_proj_ba)\.weight$"), "rows"),
    (re.compile(r"\.linear_attn\.(dt_bias|A_log)$"), "rows"),
    (re.compile(r"\.linear_attn\.out_proj\.weight$"), "heads_cols"),
)
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


def num_routed_experts(cfg: ModelConfig) -> int:
    """Routed experts of the model (``num_experts``; DeepSeek's ``n_routed_experts``)."""
    return int(cfg.num_experts or cfg.raw.get("n_routed_experts") or 0)


def is_mla(cfg: ModelConfig) -> bool:
    return bool(cfg.raw.get("kv_lora_rank"))


def expert_range(num_experts: int, rank: int, world: int, ep: int) -> tuple[int, int]:
    """``[first, stop)`` of the routed experts rank ``rank`` holds: those of its expert group
    ``rank // (world / ep)``, ``num_experts / ep`` of them."""
    per = num_experts // ep
    group = rank // (world // ep)
    return group * per, (group + 1) * per


def expert_split(rank: int, world: int, ep: int) -> tuple[int, int]:
    """``(index, ways)``: the slice of each held expert's intermediate features rank ``rank``
    holds — ``ways = world / ep`` slices, this rank's at ``rank % ways``."""
    ways = world // ep
    return rank % ways, ways


def check_divisible(cfg: ModelConfig, world: int, ep: int = 1) -> None:
    """:class:`~xllm_vmm.models.errors.LayoutError` naming the model field when ``world``
    workers (in ``ep`` expert groups) cannot split it. Whether the model's family splits at
    all (its class's ``tensor_parallel``) is the runtime's check, which knows the model
    classes; the split rules here sit below the layers and the models."""
    from xllm_vmm.engine.distributed.vocab import check_vocab
    from xllm_vmm.models.errors import LayoutError

    if world > 1 and check_vocab(cfg.vocab_size, world):
        raise LayoutError(check_vocab(cfg.vocab_size, world),
                          hint="use fewer workers (nnodes)")
    experts = num_routed_experts(cfg)
    need = [("num_attention_heads", cfg.num_heads, world)]
    dense_layers = cfg.intermediate_size and not (cfg.num_experts and all(
        cfg.is_sparse_layer(i) for i in range(cfg.num_layers)))
    if dense_layers:
        need.append(("intermediate_size", cfg.intermediate_size, world))
    if experts:
        need.append(("moe_intermediate_size", cfg.moe_intermediate_size
                     or int(cfg.raw.get("moe_intermediate_size") or 0), world // ep))
        if ep > 1:
            need.append(("num_experts" if cfg.num_experts else "n_routed_experts", experts, ep))
    elif ep > 1:
        raise LayoutError(f"ep_size={ep}: {cfg.architecture} has no routed experts to split",
                          hint="remove ep_size (ep_size=1) for a dense model")
    for field, n, ways in need:
        if n % ways:
            who = (f"{ways} expert-parallel groups" if field in ("num_experts", "n_routed_experts")
                   else f"{ways} tensor-parallel workers")
            raise LayoutError(f"{who} cannot split {field}={n} of {cfg.architecture}",
                              hint=f"use a worker count (nnodes) / ep_size that divides {n}")
    raw = cfg.raw
    for field in ("linear_num_key_heads", "linear_num_value_heads",
                  "shared_expert_intermediate_size"):
        n = int(raw.get(field) or 0)
        if world > 1 and n and n % world:
            raise LayoutError(f"{world} tensor-parallel workers cannot split {field}={n} of "
                              f"{cfg.architecture}",
                              hint=f"use a worker count (nnodes) that divides {n}")
    if is_mla(cfg):  # the latent is replicated: no KV heads to split
        return
    kv = cfg.num_kv_heads
    if (kv % world) if world <= kv else (world % kv):
        raise LayoutError(f"{world} workers can neither split nor evenly replicate the {kv} KV "
                          f"heads of {cfg.architecture}",
                          hint=f"use a worker count that divides {kv} or is a multiple of it")


def kv_head_range(num_kv_heads: int, rank: int, world: int) -> tuple[int, int]:
    """``[first, stop)`` of the KV heads rank ``rank`` holds (split, or one replicated head)."""
    if world <= num_kv_heads:
        per = num_kv_heads // world
        return rank * per, (rank + 1) * per
    head = rank // (world // num_kv_heads)
    return head, head + 1


def shard_hook(cfg: ModelConfig, rank: int, world: int, ep: int = 1
               ) -> Callable[[str, tuple[int, ...]], "ShardSpec | None"]:
    """The ``shard=`` hook of rank ``rank`` of ``world`` in ``ep`` expert groups (see the
    module table)."""
    from xllm_vmm.engine.distributed.vocab import vocab_range
    from xllm_vmm.weights import ShardSpec

    check_divisible(cfg, world, ep)
    d = cfg.head_dim
    kv0, kv1 = kv_head_range(cfg.num_kv_heads, rank, world)
    e0, e1 = expert_range(num_routed_experts(cfg), rank, world, ep)
    part, ways = expert_split(rank, world, ep)

    def hook(name: str, shape: tuple[int, ...]) -> ShardSpec | None:
        kind = next((k for rx, k in _RULES if rx.search(name)), None)
        if kind is None:
            return None
        if kind == "vocab":
            return ShardSpec(0, *vocab_range(shape[0], rank, world))
        if kind in ("heads_rows", "rows"):  # heads × per-head rows: W divides the heads
            return ShardSpec.split(0, shape[0], rank, world)
        if kind == "kv":
            return ShardSpec(0, kv0 * d, kv1 * d)
        if kind == "heads_cols":
            return ShardSpec.split(1, shape[1], rank, world)
        if kind in ("expert_in", "expert_out"):
            j = int(_EXPERT.search(name).group(1))
            if not e0 <= j < e1:
                return ShardSpec.skip()
            dim = 0 if kind == "expert_in" else 1
            return ShardSpec.split(dim, shape[dim], part, ways)
        if kind == "ffn_in":
            return ShardSpec.split(0, shape[0], rank, world)
        return ShardSpec.split(1, shape[1], rank, world)  # ffn_out

    return hook


def held_shape(hook: Callable[[str, tuple[int, ...]], Any], name: str,
               shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape a worker holds of tensor ``name`` of full ``shape`` under ``hook``."""
    spec = hook(name, tuple(shape))
    if spec is None:
        return tuple(shape)
    out = list(shape)
    out[spec.dim] = spec.stop - spec.start
    return tuple(out)
