"""The native paged prefill kernel (``xllm_paged_prefill`` of ``native/paged_attn.c``, in the
same ``libxllm_paged_attn.so`` as :mod:`.native_decode`): causal multi-query attention of
prefill and chunked-prefill chunks that reads K/V blocks in place through the block table — no
gather, no per-chunk copies of q/k/v into SDPA's layout, no materialised masks, one call for
all the chunks of a step and layer.

Semantics (the backend interface's, :mod:`.base`): chunk ``c`` holds query rows
``q_start[c] .. q_start[c+1]-1`` and ends its sequence of ``seq_lens[c]`` keys; query ``i`` of
a chunk of ``n`` queries sees keys ``j <= seq_len - n + i`` (a chunk at position 0 is plain
causal, a chunk with an offset — chunked prefill, a prefix hit — sees its cached prefix too).
The chunk's own K/V are read back from the arena, so ``write_kv`` runs first.

What runs (:func:`implementation`): with q and K/V of one dtype and head_dim a multiple of 32,
on x86-64 with AVX-512 (and AVX-512-BF16 for bfloat16), tiles of 16 queries of one KV head and
its G query heads against blocks of 64 keys with an online softmax (the 16 queries are the
vector lanes: q packed once per tile, each key's element pair broadcast from the arena row,
``vdpbf16ps`` for q·K and, on bf16 probabilities against V packed as key pairs, for P·V;
float32 FMA in the float32 form); elsewhere, or with ``XLLM_VMM_NATIVE_PREFILL=portable``, the
portable C (exact two-pass softmax per query). Work items (chunk, tile, KV head; in the AMX
form a group of up to 4 tiles sharing each key block's packed K^T and V) go to the library's
persistent thread pool, the GIL released.

When the torch backend uses it (``ENV``, :func:`default_route`): by default for every chunk
where the AMX form (bfloat16; from head_dim 128 only chunks of at most 512 queries ending
within 1,024 keys, or of at most 128 queries) or the AVX-512 float32 form runs, and for chunks of at most 32
queries where only the AVX-512-BF16 form does (measured against SDPA's flash kernel plus its
copies and masks: ``xllm-vmm bench attention``'s prefill cases, docs/engine.md); ``1`` uses it
for every prefill chunk it takes, whatever implementation runs; ``portable`` forces the
portable C for every chunk (tests: fp32 greedy equality with transformers through it); ``0``
keeps SDPA.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from xllm_vmm.engine.attention import native_decode as nd

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

ENV = "XLLM_VMM_NATIVE_PREFILL"
"""``0`` (false/off/no): prefill chunks keep SDPA; ``1`` (true/on/yes): the kernel for every
prefill chunk of a supported configuration; ``portable``: that, with the portable C forced;
unset / ``auto``: :func:`default_limit`."""

MAX_HEAD_DIM = nd.MAX_HEAD_DIM
MAX_GROUP = nd.MAX_GROUP


def mode_by_env() -> str:
    """``"off"``, ``"on"``, ``"portable"`` or ``"auto"`` from ``ENV`` (anything else: auto)."""
    v = os.environ.get(ENV, "").strip().lower()
    if v in ("0", "false", "off", "no"):
        return "off"
    if v in ("1", "true", "on", "yes"):
        return "on"
    if v == "portable":
        return "portable"
    return "auto"


IMPLS = nd.IMPLS  # one library, one set of implementation codes and flags
_flags = nd._flags


def implementation(q_dtype: Any, kv_dtype: Any, head_dim: int, *, portable: bool = False,
                   amx: bool = True) -> str:
    """Which implementation a call takes here: ``"amx-bf16"``, ``"avx512-bf16"``,
    ``"avx512-f32"`` or ``"portable"`` (``amx`` False: the AVX-512 form where AMX would
    run)."""
    lib = nd.load()
    if lib is None:
        raise ValueError(nd._NOT_BUILT)
    code = lib.xllm_paged_prefill_impl(head_dim, nd._code(q_dtype), nd._code(kv_dtype),
                                       _flags(portable, amx, nd._bf16(q_dtype, kv_dtype)))
    return IMPLS[code]


def supports(q_dtype: Any, kv_dtype: Any, device: Any, num_heads: int, num_kv_heads: int,
             head_dim: int) -> bool:
    """The kernel takes this configuration (the decode kernel's limits: CPU, float32/bfloat16,
    head_dim <= 512, at most 16 query heads per KV head) and the library is loaded."""
    return nd.supports(q_dtype, kv_dtype, device, num_heads, num_kv_heads, head_dim)


AVX512_BF16_MAX_QUERIES = 32
"""Longest chunk the ``auto`` choice gives the AVX-512-BF16 form (where AMX does not run):
measured cheaper than SDPA up to 32 queries a chunk and dearer from 128 (docs/engine.md)."""


AMX_WIDE_HEAD_DIM = 128
"""From this head_dim the AMX form's ``auto`` chunks are bounded by their keys too
(``AMX_WIDE_ROUTE``): at head_dim 128 it measured dearer than SDPA on long chunks (2 threads,
quiet, 19:16 UTC: 2,048 queries at offset 0 0.62-0.69 of SDPA's speed, 1,024 at 0 0.85, 512 at
1,024 0.83, 256 at 1,024 0.89) and cheaper on the rest (512 at 0 1.2, 512 at 512 1.11, 128 at
1,024 1.07, 32 at 1,024 2.0); at head_dim 64 it was cheaper in every case."""

AMX_WIDE_ROUTE = (512, 1024, 128)
"""``(max_queries, max_keys, any_keys_queries)`` of the AMX form from ``AMX_WIDE_HEAD_DIM``:
a chunk of ``n`` queries ending at key ``seq_len`` runs natively iff ``n <= 512`` and
(``seq_len <= 1024`` or ``n <= 128``)."""

UNBOUNDED = 1 << 62


def default_route(q_dtype: Any, kv_dtype: Any, head_dim: int) -> tuple[int, int, int]:
    """The ``auto`` choice as ``(max_queries, max_keys, any_keys_queries)``: a chunk of ``n``
    queries ending at key ``seq_len`` runs natively iff ``n <= max_queries`` and
    (``seq_len <= max_keys`` or ``n <= any_keys_queries``) (:func:`route_takes`). Every chunk
    where the AMX form (bfloat16, below ``AMX_WIDE_HEAD_DIM``) or the AVX-512 float32 form
    runs; ``AMX_WIDE_ROUTE`` for the AMX form from ``AMX_WIDE_HEAD_DIM``; chunks of at most
    ``AVX512_BF16_MAX_QUERIES`` where only the AVX-512-BF16 form does (bfloat16 without AMX);
    none (0) where only the portable C would (SDPA is faster than plain loops). Measured
    against SDPA's flash kernel: docs/engine.md."""
    impl = implementation(q_dtype, kv_dtype, head_dim)
    if impl == "amx-bf16" and head_dim >= AMX_WIDE_HEAD_DIM:
        return AMX_WIDE_ROUTE
    if impl in ("amx-bf16", "avx512-f32"):
        return (UNBOUNDED, UNBOUNDED, UNBOUNDED)
    if impl == "avx512-bf16":
        return (AVX512_BF16_MAX_QUERIES, UNBOUNDED, UNBOUNDED)
    return (0, 0, 0)


def route_takes(route: tuple[int, int, int], n: int, seq_len: int) -> bool:
    """Whether ``route`` (:func:`default_route`) sends a chunk of ``n`` queries ending at key
    ``seq_len`` to the kernel."""
    return n <= route[0] and (seq_len <= route[1] or n <= route[2])


def default_limit(q_dtype: Any, kv_dtype: Any, head_dim: int) -> int:
    """The longest chunk (queries) the ``auto`` choice gives the kernel
    (:func:`default_route`'s first field)."""
    return default_route(q_dtype, kv_dtype, head_dim)[0]


def paged_prefill(q: Tensor, k_slots: Tensor, v_slots: Tensor, block_table: Tensor,
                  q_start: Tensor, q_end: Tensor, seq_lens: Tensor, *, block_size: int, blocks_per_slot: int,
                  scale: float, out: Tensor | None = None, num_threads: int | None = None,
                  portable: bool | None = None, amx: bool = True) -> Tensor:
    """Causal attention of ``C`` chunks written into ``out`` ``(T, H, D)`` (q's dtype; a new
    tensor when None) and returned: rows ``q_start[c] .. q_end[c]-1`` (``n_c`` rows, chunks
    in any order, no row in two chunks) of ``out`` are the attention of those rows of ``q``
    over keys ``j <= seq_lens[c] - n_c + i`` of their sequence, read in place through
    ``block_table`` ``(C, nb)`` from the layer's ``slots`` views; other rows of ``out`` are
    left as they are. ``0 <= q_start[c]``, ``q_end[c] <= T`` and
    ``1 <= n_c <= seq_lens[c] <= nb * block_size``; the table entries below
    ``ceil(seq_lens[c] / block_size)`` must be blocks the manager handed out (ids outside the
    views are refused), the entries beyond are never read. ``portable`` (None: ``ENV`` is
    ``portable``) forces the portable C; ``amx`` False keeps the AVX-512 form where the AMX
    tiles would run.

    Raises ``ValueError`` naming the argument on a shape, dtype, device or range the kernel
    does not take; nothing is written then."""
    import torch

    lib = nd.load()
    if lib is None:
        raise ValueError(nd._NOT_BUILT)
    qt, kt, t_rows, h, d, s, hkv = nd.check_paged_views(
        q, k_slots, v_slots, block_size=block_size, blocks_per_slot=blocks_per_slot,
        kernel="prefill")
    q = q.contiguous()
    table = nd._int64(block_table, "block_table")
    starts = nd._int64(q_start, "q_start")
    ends = nd._int64(q_end, "q_end")
    lens = nd._int64(seq_lens, "seq_lens")
    if table.dim() != 2 or lens.dim() != 1 or table.shape[0] != lens.shape[0]:
        raise ValueError(f"block_table {tuple(table.shape)} and seq_lens {tuple(lens.shape)} "
                         "must be (C, nb) and (C,)")
    c = lens.shape[0]
    if starts.shape != (c,) or ends.shape != (c,):
        raise ValueError(f"q_start {tuple(starts.shape)} / q_end {tuple(ends.shape)} must be "
                         f"({c},), one per chunk")
    out = nd.output_for(q, out)
    if c == 0:
        return out
    if portable is None:
        portable = mode_by_env() == "portable"
    n = torch.get_num_threads() if num_threads is None else num_threads
    rc = lib.xllm_paged_prefill(
        q.data_ptr(), out.data_ptr(), t_rows, k_slots.data_ptr(), v_slots.data_ptr(),
        table.data_ptr(), table.shape[1], table.shape[1], starts.data_ptr(), ends.data_ptr(),
        lens.data_ptr(), c,
        h, hkv, d, block_size, blocks_per_slot, k_slots.stride(0), s * blocks_per_slot,
        float(scale), qt, kt, int(n), _flags(bool(portable), amx, 1 in (qt, kt)))
    if rc == -3:
        raise ValueError(f"block_table holds a block id outside [0, {s * blocks_per_slot}) of "
                         "the views")
    if rc == -2:
        raise MemoryError("xllm_paged_prefill: out of memory for its work buffers")
    if rc != 0:
        raise ValueError(f"each chunk needs 0 <= q_start < q_end <= {t_rows} and "
                         f"1 <= n = q_end - q_start <= seq_len <= nb * block_size = {table.shape[1] * block_size}"
                         f" (xllm_paged_prefill rc {rc})")
    return out


__all__ = ["AMX_WIDE_HEAD_DIM", "AMX_WIDE_ROUTE", "AVX512_BF16_MAX_QUERIES", "ENV", "IMPLS",
           "UNBOUNDED", "default_limit", "default_route", "implementation", "route_takes",
           "mode_by_env", "paged_prefill", "supports"]
