"""The native paged decode kernel (``native/paged_attn.c``, ``libxllm_paged_attn.so``): decode
attention that reads K/V blocks in place through the block table — no gather copy, no padding
to the longest sequence — and writes each decode's output straight into its row of the step's
output, called through ctypes (the GIL is released).

What runs (``implementation``): on x86-64 with AVX-512 (F/BW/VL, and AVX-512-BF16 for bfloat16)
and q of the K/V dtype with a head_dim multiple of 16, the AVX-512 kernel — one work item per
(sequence, KV head) reading each K/V row from memory once for all query heads of the group,
scores 16 keys at a time (``vdpbf16ps`` on bf16 pairs, FMA in float32) with a transpose-tree
reduction, an exact two-pass softmax with a vectorised ``exp2``, V accumulated in float32
registers, bf16 results rounded to nearest even — with bf16, a head_dim a multiple of 32 up to
128 and AMX-BF16 granted by Linux (``"amx-bf16"``), the scores of every whole 16-key tile inside
one block on the AMX tiles instead (K's rows loaded straight from the arena, q^T packed once per
item; 0.81-0.85 of the AVX-512 form's CPU cache-resident, 0.93-0.97 from memory, loaded;
``XLLM_VMM_NATIVE_DECODE=avx512`` keeps the AVX-512 scores); elsewhere (aarch64, older x86,
mixed dtypes, other head sizes, or ``XLLM_VMM_NATIVE_DECODE=portable``) the portable C of the
same arithmetic.
Work items are taken dynamically by the library's persistent thread pool (``native/threadpool.h``,
``torch.get_num_threads()`` threads, the caller's included).

It is the torch backend's default for CPU decodes (``XLLM_VMM_NATIVE_DECODE=0`` or
``TorchSDPABackend(native_decode=False)`` turn it off), because it measured cheaper than the
bucketed gather + SDPA path it replaces (``xllm-vmm bench attention``, loaded machine, CPU time
of one layer call, H=8 over 4 KV heads, decodes of 64-640 keys, one thread): 2.5-3.6x less in
every case, e.g. 128 decodes at D=64 5.3 against 12.9 ms in bf16, 10.1 against 31.3 in fp32;
whole ``LLM.generate`` of `bench engine`'s trace (bf16, 2 threads, interleaved): 8.1-9.8 s of CPU
against 11.5-13.5 s with it off, and near-quiet 3,175-3,233 against 2,033-2,055 output
tokens/s (``docs/engine.md``). In the engine it is bound by memory
bandwidth (the K/V of the other layers evict a layer's between steps). The torch path
stays for what the kernel does not take (CUDA, float16, more than 16 query heads per KV head,
head_dim above 512), decided once per dtype pair by :func:`supports`.
:func:`paged_decode` checks shapes, dtypes, devices, lengths and block ids and raises
``ValueError`` naming the argument; nothing is written then.
"""

from __future__ import annotations

import ctypes
import os
from typing import TYPE_CHECKING, Any

from xllm_vmm.engine.native_threads import prototype as _threads_prototype

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

LIB_NAME = "libxllm_paged_attn.so"
ENV = "XLLM_VMM_NATIVE_DECODE"
"""``0`` (false/off/no) turns the native decode kernel off for the torch backend's default (on
otherwise, where the library is built); ``portable`` keeps it on with its portable C
implementation; ``avx512`` keeps it on with its bf16 scores on AVX-512 where the AMX form would
run (A/B comparisons)."""

_I64, _PTR, _I32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_ATTACHED: Any = None  # the library whose threads were handed to engine.native_threads
_PROTOTYPES: dict[str, tuple[list, Any]] = {
    "xllm_paged_decode": ([_PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _I64, _I64,
                           _I64, _I64, _I64, _I64, _I64, _I64, ctypes.c_float, _I32, _I32, _I32,
                           _I32], _I32),
    "xllm_paged_decode_impl": ([_I64, _I32, _I32, _I32], _I32),
    "xllm_write_kv": ([_PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64,
                       _I64, _I64], _I32),
    "xllm_paged_attn_isa": ([], _I32),
    "xllm_paged_attn_use_omp": _threads_prototype(),
    # the prefill kernel of the same library (wrapped by native_prefill)
    "xllm_paged_prefill": ([_PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR,
                            _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, ctypes.c_float, _I32,
                            _I32, _I32, _I32], _I32),
    "xllm_paged_prefill_impl": ([_I64, _I32, _I32, _I32], _I32),
    "xllm_stream_read": ([_PTR, _I64, _I32], ctypes.c_uint64),  # bench attention's roofline
}


def enabled_by_env() -> bool:
    """The kernel is on unless ``ENV`` turns it off (0/false/off/no)."""
    return os.environ.get(ENV, "").strip().lower() not in ("0", "false", "off", "no")


def portable_by_env() -> bool:
    """``ENV=portable``: the kernel's portable C implementation even where AVX-512 runs (tests,
    comparisons)."""
    return os.environ.get(ENV, "").strip().lower() == "portable"


def amx_by_env() -> bool:
    """The AMX scores may run (``ENV`` is not ``avx512``)."""
    return os.environ.get(ENV, "").strip().lower() != "avx512"


def load() -> Any:
    """The ctypes library, or None when it is not built (:func:`xllm_vmm.vmm.native.optional_library`).
    On first load its threads are handed to :mod:`xllm_vmm.engine.native_threads` (torch's
    OpenMP team by default)."""
    global _ATTACHED
    from xllm_vmm.vmm.native import optional_library

    lib = optional_library(LIB_NAME, _PROTOTYPES)
    if lib is not None and _ATTACHED is not lib:
        from xllm_vmm.engine import native_threads

        native_threads.attach(lib.xllm_paged_attn_use_omp)
        _ATTACHED = lib
    return lib


def _code(dtype: Any) -> int | None:
    import torch

    return {torch.float32: 0, torch.bfloat16: 1}.get(dtype)


def supports(q_dtype: Any, kv_dtype: Any, device: Any, num_heads: int, num_kv_heads: int,
             head_dim: int) -> bool:
    """The kernel runs this configuration (CPU; float32/bfloat16; head_dim <= 512; at most 16
    query heads per KV head) and the library is loaded."""
    import torch

    return (load() is not None and torch.device(device).type == "cpu"
            and _code(q_dtype) is not None and _code(kv_dtype) is not None
            and 1 <= head_dim <= MAX_HEAD_DIM and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= MAX_GROUP)


def _bf16(q_dtype: Any, kv_dtype: Any) -> bool:
    return 1 in (_code(q_dtype), _code(kv_dtype))


IMPLS = {0: "portable", 1: "avx512-f32", 2: "avx512-bf16", 3: "amx-bf16"}
PORTABLE, NO_AMX = 1, 2  # the library's flags


def _flags(portable: bool, amx: bool, bf16: bool = False) -> int:
    """The library's flags; a capability hidden by ``XLLM_VMM_CPU_HIDE``
    (:mod:`xllm_vmm.engine.cpu_caps`) forces its absence: ``avx512`` the portable C,
    ``avx512_bf16`` the portable C for a call with bfloat16 operands (``bf16``), ``amx`` the
    AVX-512 scores."""
    from xllm_vmm.engine import cpu_caps

    portable = portable or cpu_caps.hides("avx512") or bf16 and cpu_caps.hides("avx512_bf16")
    amx = amx and not cpu_caps.hides("amx")
    return (PORTABLE if portable else 0) | (0 if amx else NO_AMX)


def implementation(q_dtype: Any, kv_dtype: Any, head_dim: int, *, portable: bool = False,
                   amx: bool = True) -> str:
    """Which implementation a call takes here: ``"amx-bf16"`` (the AVX-512-BF16 kernel with
    its q.K scores on the AMX tiles: bfloat16, head_dim a multiple of 32 up to 128, where the
    CPU has AMX-BF16 and Linux grants the tiles; ``amx`` False keeps ``"avx512-bf16"``),
    ``"avx512-bf16"``, ``"avx512-f32"`` or ``"portable"`` (no AVX-512 / AVX-512-BF16 on this
    CPU, q and K/V of different dtypes, a head_dim not a multiple of 16, or ``portable``)."""
    lib = load()
    if lib is None:
        raise ValueError(_NOT_BUILT)
    code = lib.xllm_paged_decode_impl(head_dim, _code(q_dtype), _code(kv_dtype),
                                      _flags(portable, amx, _bf16(q_dtype, kv_dtype)))
    return IMPLS[code]


_NOT_BUILT = (f"the native decode kernel is not available ({LIB_NAME} is not built: "
              "python setup.py build_ext --inplace)")
MAX_HEAD_DIM = 512
MAX_GROUP = 16


def _int64(t: Any, name: str) -> Any:
    import torch

    if t.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
    return t.to(torch.int64).contiguous()


def output_for(q: Tensor, out: Tensor | None) -> Tensor:
    """The paged kernels' output: a new tensor like ``q`` when ``out`` is None, else ``out``
    once checked to be a contiguous CPU tensor of q's shape and dtype (``ValueError`` naming
    it otherwise)."""
    import torch

    if out is None:  # padded rows for the o product (row_buckets)
        from xllm_vmm.engine.row_buckets import empty_rows_like

        return empty_rows_like(q)
    if (out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous()
            or out.device.type != "cpu"):
        raise ValueError(f"out must be a contiguous CPU {q.dtype} tensor of q's shape "
                         f"{tuple(q.shape)}, got {out.dtype} {tuple(out.shape)}")
    return out


def check_paged_views(q: Tensor, k_slots: Tensor, v_slots: Tensor, *, block_size: int,
                      blocks_per_slot: int, kernel: str = "decode") -> tuple[int, ...]:
    """The argument checks the paged kernels (decode and prefill) share: ``q`` ``(T, H, D)``,
    two ``(S, tokens, Hkv, D)`` token-major CPU views of one shape and dtype, GQA within
    ``MAX_GROUP``, ``D <= MAX_HEAD_DIM``, ``tokens == block_size * blocks_per_slot``. Returns
    ``(q_code, kv_code, T, H, D, S, Hkv)``; raises ``ValueError`` naming the argument."""
    if q.dim() != 3:
        raise ValueError(f"q must be (T, H, D), got shape {tuple(q.shape)}")
    if k_slots.dim() != 4 or tuple(v_slots.shape) != tuple(k_slots.shape):
        raise ValueError(f"k_slots/v_slots must be two (S, tokens, Hkv, D) views of one shape, "
                         f"got {tuple(k_slots.shape)} / {tuple(v_slots.shape)}")
    for name, t in (("q", q), ("k_slots", k_slots), ("v_slots", v_slots)):
        if t.device.type != "cpu":
            raise ValueError(f"{name} is on {t.device}; the native {kernel} kernel runs on CPU")
    qt, kt = _code(q.dtype), _code(k_slots.dtype)
    if qt is None:
        raise ValueError(f"q must be float32 or bfloat16, got {q.dtype}")
    if kt is None or v_slots.dtype != k_slots.dtype:
        raise ValueError(f"k_slots/v_slots must be float32 or bfloat16 and alike, got "
                         f"{k_slots.dtype} / {v_slots.dtype}")
    t_rows, h, d = q.shape
    s, tokens, hkv, dk = k_slots.shape
    if dk != d:
        raise ValueError(f"k_slots head_dim {dk} differs from q's {d}")
    if h % hkv or h // hkv > MAX_GROUP or d > MAX_HEAD_DIM:
        raise ValueError(f"q heads {h} over K/V heads {hkv}: the kernel needs H a multiple of "
                         f"Hkv with H/Hkv <= {MAX_GROUP}, and head_dim <= {MAX_HEAD_DIM} "
                         f"(got {d})")
    if k_slots.stride()[1:] != (hkv * d, d, 1) or v_slots.stride() != k_slots.stride():
        raise ValueError("k_slots/v_slots must be token-major views with equal strides "
                         f"(page, Hkv*D, D, 1), got {k_slots.stride()} / {v_slots.stride()}")
    if block_size < 1 or blocks_per_slot < 1 or tokens != block_size * blocks_per_slot:
        raise ValueError(f"block_size {block_size} x blocks_per_slot {blocks_per_slot} must "
                         f"equal the views' tokens per slot {tokens}")
    return qt, kt, t_rows, h, d, s, hkv


def paged_decode(q: Tensor, k_slots: Tensor, v_slots: Tensor, block_table: Tensor,
                 seq_lens: Tensor, *, block_size: int, blocks_per_slot: int, scale: float,
                 rows: Tensor | None = None, out: Tensor | None = None,
                 num_threads: int | None = None, portable: bool | None = None,
                 amx: bool = True) -> Tensor:
    """Decode attention written into ``out`` ``(T, H, D)`` (q's dtype; a new tensor when None)
    and returned: for decode ``b``, row ``r = rows[b]`` (``rows`` None: ``r = b``, ``B = T``)
    of ``out`` is the attention of query row ``q[r]`` over the keys ``0 .. seq_lens[b] - 1`` of
    its sequence, read in place through ``block_table`` ``(B, nb)`` from the layer's ``slots``
    views (``(S, Bps * block_size, Hkv, D)``, page stride ``stride(0)``); rows of ``out`` not
    in ``rows`` are left as they are. Every table entry below ``ceil(seq_lens[b] /
    block_size)`` must be a block the manager handed out (invariant 1; ids outside the views
    are refused); entries beyond, and a block's slots beyond ``seq_lens[b]``, are never read.
    ``portable`` (None: the ``ENV`` setting) forces the portable C implementation; ``amx``
    False keeps the AVX-512 scores where the AMX form would run (:func:`implementation`).

    Raises ``ValueError`` naming the argument on a shape, dtype, device or range the kernel
    does not take; nothing is written then."""
    import torch

    lib = load()
    if lib is None:
        raise ValueError(_NOT_BUILT)
    qt, kt, t_rows, h, d, s, hkv = check_paged_views(q, k_slots, v_slots, block_size=block_size,
                                                     blocks_per_slot=blocks_per_slot)
    q = q.contiguous()
    table = _int64(block_table, "block_table")
    lens = _int64(seq_lens, "seq_lens")
    if table.dim() != 2 or lens.dim() != 1 or table.shape[0] != lens.shape[0]:
        raise ValueError(f"block_table {tuple(table.shape)} and seq_lens {tuple(lens.shape)} "
                         "must be (B, nb) and (B,)")
    b = lens.shape[0]
    if rows is None:
        if b != t_rows:
            raise ValueError(f"without rows, seq_lens must have one entry per q row ({t_rows}), "
                             f"got {b}")
        rows_t = None
    else:
        rows_t = _int64(rows, "rows")
        if rows_t.shape != (b,):
            raise ValueError(f"rows {tuple(rows_t.shape)} must be ({b},), one per sequence")
    out = output_for(q, out)
    if portable is None:
        portable = portable_by_env()
    n = torch.get_num_threads() if num_threads is None else num_threads
    if b == 0:
        return out
    rc = lib.xllm_paged_decode(
        q.data_ptr(), out.data_ptr(), None if rows_t is None else rows_t.data_ptr(), t_rows,
        k_slots.data_ptr(), v_slots.data_ptr(), table.data_ptr(), table.shape[1], table.shape[1],
        lens.data_ptr(), b, h, hkv, d, block_size, blocks_per_slot, k_slots.stride(0),
        s * blocks_per_slot, float(scale), qt, kt, int(n),
        _flags(bool(portable), amx, 1 in (qt, kt)))
    if rc == -3:
        raise ValueError(f"block_table holds a block id outside [0, {s * blocks_per_slot}) of "
                         f"the views, or rows a row outside [0, {t_rows})")
    if rc == -2:
        raise MemoryError("xllm_paged_decode: out of memory for its score buffers")
    if rc != 0:
        raise ValueError(f"seq_lens must be in [1, nb * block_size = "
                         f"{table.shape[1] * block_size}] (xllm_paged_decode rc {rc})")
    return out


def write_kv(k: Tensor, v: Tensor, k_slots: Tensor, v_slots: Tensor, page: Tensor,
             off: Tensor) -> bool:
    """Store the step's new ``k``/``v`` ``(T, Hkv, D)`` rows at token ``off[t]`` of slot
    ``page[t]`` of the ``slots`` views (what ``slots.index_put_((page, off), k)`` does), in one
    native call. Returns False, having written nothing, when it does not take the tensors
    (library not built, not CPU, a dtype other than the views' float32/bfloat16, rows not
    contiguous inside, ``page``/``off`` not contiguous int64) — the caller then uses torch.
    Raises ``ValueError`` on a page or offset outside the views (nothing written)."""
    import torch

    lib = load()
    if (lib is None or k.device.type != "cpu" or v.device.type != "cpu"
            or k_slots.device.type != "cpu" or k.dtype != k_slots.dtype
            or v.dtype != v_slots.dtype or k.dtype != v.dtype or _code(k.dtype) is None
            or k.dim() != 3 or v.shape != k.shape or tuple(k.shape[1:]) != tuple(k_slots.shape[2:])
            or k.stride()[1:] != (k.shape[2], 1) or v.stride()[1:] != (v.shape[2], 1)
            or k_slots.stride() != v_slots.stride()
            or k_slots.stride()[1:] != (k.shape[1] * k.shape[2], k.shape[2], 1)
            or page.dtype != torch.int64 or off.dtype != torch.int64
            or not page.is_contiguous() or not off.is_contiguous()
            or page.shape != (k.shape[0],) or off.shape != (k.shape[0],)):
        return False
    t, row = k.shape[0], k.shape[1] * k.shape[2]
    sk, sv = (k.stride(0), v.stride(0)) if t > 1 else (row, row)
    if sk < row or sv < row:  # rows overlapping in memory: not a layout this takes
        return False
    rc = lib.xllm_write_kv(k.data_ptr(), v.data_ptr(), sk, sv, k_slots.data_ptr(),
                           v_slots.data_ptr(), page.data_ptr(), off.data_ptr(), t, row,
                           k.element_size(), k_slots.stride(0), k_slots.shape[0],
                           k_slots.shape[1])
    if rc == -3:
        raise ValueError(f"write_kv: a page outside [0, {k_slots.shape[0]}) or an offset outside "
                         f"[0, {k_slots.shape[1]}) of the slots views")
    if rc != 0:
        raise ValueError(f"write_kv refused its arguments (rc {rc})")
    return True


__all__ = ["ENV", "IMPLS", "LIB_NAME", "amx_by_env", "enabled_by_env", "implementation", "load",
           "paged_decode", "portable_by_env", "supports", "write_kv"]
