"""What each tensor-parallel worker loads of a checkpoint: the one home of the split rules.

:func:`shard_hook` answers :func:`xllm_vmm.weights.load_weights`'s ``shard(name, shape)`` so a
worker reads only its part of every tensor (Hugging Face names):

| tensor | split |
|---|---|
| ``model.embed_tokens.weight``, ``lm_head.weight`` | rows (vocabulary): ``ceil(vocab / W)`` each, the last rank the rest (:func:`~xllm_vmm.engine.distributed.vocab.vocab_range`) |
| ``*.self_attn.q_proj.{weight,bias}`` | rows: ``heads / W`` attention heads × ``head_dim`` |
| ``*.self_attn.{k,v}_proj.{weight,bias}`` | rows: ``kv_heads / W`` KV heads; when ``W > kv_heads`` one head, rank ``r`` holding head ``r // (W / kv_heads)`` (replicated, as :func:`xllm_vmm.models.layout.kv_heads_per_worker` counts it) |
| ``*.self_attn.o_proj.weight`` | columns: the same heads as ``q_proj`` |
| ``*.mlp.{gate,up}_proj.{weight,bias}``, ``*.mlp.experts.N.{gate,up}_proj.weight`` | rows: ``intermediate / W`` |
| ``*.mlp.down_proj.weight``, ``*.mlp.experts.N.down_proj.weight`` | columns: ``intermediate / W`` |
| everything else (norms, q/k norms, the MoE router, ``o_proj``/``down_proj`` biases) | whole |

The layers (``xllm_vmm.engine.layers``) are told through ``TensorParallel.shard_hook`` that their
tensors are already this rank's part; a row-parallel bias is added once after the all-reduce.
:func:`check_divisible` states what ``W`` must divide, with the model's numbers, before
anything is loaded.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # pragma: no cover
    from xllm_vmm.engine.models.config import ModelConfig
    from xllm_vmm.weights import ShardSpec

_RULES = (
    (re.compile(r"^(model\.embed_tokens|lm_head)\.weight$"), "vocab"),
    (re.compile(r"\.self_attn\.q_proj\.(weight|bias)$"), "q"),
    (re.compile(r"\.self_attn\.[kv]_proj\.(weight|bias)$"), "kv"),
    (re.compile(r"\.self_attn\.o_proj\.weight$"), "o"),
    (re.compile(r"\.mlp\.(experts\.\d+\.)?(gate|up)_proj\.(weight|bias)$"), "ffn_in"),
    (re.compile(r"\.mlp\.(experts\.\d+\.)?down_proj\.weight$"), "ffn_out"),
)


def check_divisible(cfg: ModelConfig, world: int) -> None:
    """ValueError naming the model field when ``world`` workers cannot split it."""
    from xllm_vmm.engine.models import model_class
    from xllm_vmm.models.errors import LayoutError

    if world > 1 and not model_class(cfg.architecture).tensor_parallel:
        raise LayoutError(f"{cfg.architecture} runs on one worker only in this engine (no "
                          "tensor-parallel split of this family yet)", hint="use nnodes=1")
    from xllm_vmm.engine.distributed.vocab import check_vocab

    if world > 1 and check_vocab(cfg.vocab_size, world):
        raise LayoutError(check_vocab(cfg.vocab_size, world),
                          hint="use fewer workers (nnodes)")
    need = [("num_attention_heads", cfg.num_heads)]
    if cfg.intermediate_size and not (cfg.num_experts and all(
            cfg.is_sparse_layer(i) for i in range(cfg.num_layers))):
        need.append(("intermediate_size", cfg.intermediate_size))
    if cfg.num_experts:
        need.append(("moe_intermediate_size", cfg.moe_intermediate_size))
    for field, n in need:
        if n % world:
            raise LayoutError(f"{world} tensor-parallel workers cannot split {field}={n} of "
                              f"{cfg.architecture}",
                              hint=f"use a worker count (nnodes) that divides {n}")
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


def shard_hook(cfg: ModelConfig, rank: int, world: int
               ) -> Callable[[str, tuple[int, ...]], "ShardSpec | None"]:
    """The ``shard=`` hook of rank ``rank`` of ``world`` (see the module table)."""
    from xllm_vmm.engine.distributed.vocab import vocab_range
    from xllm_vmm.weights import ShardSpec

    check_divisible(cfg, world)
    d = cfg.head_dim
    heads = cfg.num_heads // world
    kv0, kv1 = kv_head_range(cfg.num_kv_heads, rank, world)

    def hook(name: str, shape: tuple[int, ...]) -> ShardSpec | None:
        kind = next((k for rx, k in _RULES if rx.search(name)), None)
        if kind is None:
            return None
        if kind == "vocab":
            return ShardSpec(0, *vocab_range(shape[0], rank, world))
        if kind == "q":
            return ShardSpec(0, rank * heads * d, (rank + 1) * heads * d)
        if kind == "kv":
            return ShardSpec(0, kv0 * d, kv1 * d)
        if kind == "o":
            return ShardSpec(1, rank * heads * d, (rank + 1) * heads * d)
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
