"""Where each tensor goes: the *image* of a checkpoint, one byte range laid out exactly like the
weights tenant's region (and like the host copy, which mirrors it byte for byte).

``plan_image(checkpoint, dtype, shard)`` places every tensor at an offset aligned to
:data:`TENSOR_ALIGN` bytes, in checkpoint order (file, then offset: reading is sequential),
except that each layer's projections of one input — ``*.q_proj``, ``*.k_proj``, ``*.v_proj``
(weights, and biases) and ``*.gate_proj``, ``*.up_proj`` — are placed together in that order
where the group's first tensor falls (:func:`placement_order`): with sizes that are multiples
of the alignment (the usual case) they lie back to back, and the engine runs each group as one
product over a view of the image (``engine.layers.fusion``), never a copy.
A placed tensor is the whole tensor, or the part a shard hook chose (indices ``[start, stop)``
along one dimension), converted to ``dtype`` when one was asked for and the tensor is
floating point (F16/BF16/F32/F64; integer and quantized tensors keep their dtype).
:meth:`WeightImage.fill` writes placed tensors into host memory: a tensor read whole, or a
dimension-0 shard without conversion, is one ``preadv`` straight into the destination (the
file's own bytes); anything else is read whole into a scratch tensor, cut and converted there.
The bytes between tensors (alignment padding) are zero.

Units: bytes; offsets are relative to the start of the image (= the region's first byte).
"""

from __future__ import annotations

import ctypes as C
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

from xllm_vmm.weights.checkpoint import (CONVERTIBLE, ITEM_BYTES, Checkpoint, ShardHook,
                                         ShardSpec, TensorEntry, host_buffer, read_into,
                                         torch_dtype)
from xllm_vmm.weights.errors import CheckpointError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["TENSOR_ALIGN", "Placed", "WeightImage", "placement_order", "plan_image",
           "projection_groups", "st_dtype_of"]

#: Every tensor starts at a multiple of this many bytes (512: what NPU kernels want; CUDA 256).
TENSOR_ALIGN = 512

_ST_OF_TORCH = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64"}


def st_dtype_of(dtype: "torch.dtype | None") -> str | None:
    """The safetensors name of a ``dtype=`` argument (floating point only), or None."""
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    if name not in _ST_OF_TORCH:
        raise ValueError(f"dtype={dtype} is not a floating-point dtype the loader converts to "
                         f"(choose one of torch.{', torch.'.join(_ST_OF_TORCH)}, or None to "
                         "keep the checkpoint's dtypes)")
    return _ST_OF_TORCH[name]


@dataclass(frozen=True)
class Placed:
    """One tensor of the image: ``nbytes`` bytes of ``dtype``/``shape`` at ``offset``."""

    entry: TensorEntry
    shard: ShardSpec | None
    dtype: str  # safetensors dtype name of the loaded tensor
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def name(self) -> str:
        return self.entry.name

    def direct_range(self) -> tuple[int, int] | None:
        """``(file offset, bytes)`` when the tensor is one contiguous run of the file (whole,
        or a dimension-0 shard) with no conversion; None otherwise."""
        if self.dtype != self.entry.dtype:
            return None
        if self.shard is None:
            return self.entry.offset, self.entry.nbytes
        if self.shard.dim == 0:
            row = math.prod(self.entry.shape[1:]) * self.entry.item_bytes
            return self.entry.offset + self.shard.start * row, self.nbytes
        return None


@dataclass(frozen=True)
class WeightImage:
    """Placed tensors in offset order; ``nbytes`` = end of the last one (the region's used
    bytes, before rounding up to pages)."""

    checkpoint: Checkpoint
    placed: tuple[Placed, ...]
    nbytes: int

    @property
    def tensor_bytes(self) -> int:
        return sum(p.nbytes for p in self.placed)

    def windows(self, limit: int) -> list[tuple[int, int, tuple[Placed, ...]]]:
        """Consecutive ranges ``(lo, hi, tensors)`` covering ``[0, nbytes)`` exactly (copy and
        staging units). The tensors of a window end within ``limit`` bytes of ``lo`` unless one
        tensor alone is larger; the window also takes the padding up to the next tensor (less
        than :data:`TENSOR_ALIGN` bytes)."""
        out: list[tuple[int, int, tuple[Placed, ...]]] = []
        placed, i, lo = self.placed, 0, 0
        while i < len(placed):
            j = i + 1
            while j < len(placed) and placed[j].offset + placed[j].nbytes - lo <= limit:
                j += 1
            hi = placed[j].offset if j < len(placed) else self.nbytes
            out.append((lo, hi, placed[i:j]))
            lo, i = hi, j
        if not out:
            out.append((0, self.nbytes, ()))
        return out

    def fill(self, dst: int, placed: Iterable[Placed], *, base: int = 0,
             span: tuple[int, int] | None = None,
             progress: Callable[[int], None] | None = None, files: dict | None = None) -> None:
        """Writes each of ``placed`` to host address ``dst + p.offset - base`` (the caller owns
        the memory), then calls ``progress(p.nbytes)``. With ``span=(lo, hi)`` the bytes of
        ``[lo, hi)`` that no tensor covers (alignment padding) are zeroed too. ``files``: open
        file objects to reuse across calls (the caller closes them); None opens and closes."""
        own = files is None
        files = {} if own else files
        cursor = None if span is None else span[0]
        try:
            for p in placed:
                if cursor is not None and p.offset > cursor:
                    zero(dst + cursor - base, p.offset - cursor)
                if p.nbytes:
                    self._fill_one(p, dst + p.offset - base, files)
                if cursor is not None:
                    cursor = max(cursor, p.offset + p.nbytes)
                if progress is not None:
                    progress(p.nbytes)
            if span is not None and cursor < span[1]:
                zero(dst + cursor - base, span[1] - cursor)
        finally:
            if own:
                for fh in files.values():
                    fh.close()

    def _fill_one(self, p: Placed, addr: int, files: dict) -> None:
        e = p.entry
        fh = files.get(e.file)
        if fh is None:
            try:
                fh = files[e.file] = open(e.file, "rb")
            except OSError as exc:
                raise CheckpointError(f"cannot open: {exc.strerror or exc}", source=str(e.file),
                                      hint="check that the checkpoint is still there") from exc
        direct = p.direct_range()
        if direct is not None:
            read_into(fh, direct[0], direct[1], host_buffer(addr, p.nbytes), str(e.file))
            return
        import torch

        raw = torch.empty(e.nbytes, dtype=torch.uint8)
        read_into(fh, e.offset, e.nbytes, memoryview(raw.numpy()), str(e.file))
        t = raw.view(torch_dtype(e.dtype)).view(e.shape)
        if p.shard is not None:
            t = t.narrow(p.shard.dim, p.shard.start, p.shard.stop - p.shard.start)
        out = torch.frombuffer(host_buffer(addr, p.nbytes), dtype=torch.uint8)
        out.view(torch_dtype(p.dtype)).view(p.shape).copy_(t)


def _check_shard(e: TensorEntry, spec: object) -> ShardSpec | None:
    if spec is None:
        return None
    hint = "fix the shard hook passed to load_weights(shard=...)"
    if not isinstance(spec, ShardSpec):
        raise CheckpointError(f"the shard hook answered {spec!r} for tensor {e.name!r}; it must "
                              "answer a ShardSpec or None", source=str(e.file), hint=hint)
    ndim = len(e.shape)
    if not 0 <= spec.dim < ndim:
        raise CheckpointError(f"shard of tensor {e.name!r} along dim {spec.dim}, but the tensor "
                              f"has shape {e.shape}", source=str(e.file), hint=hint)
    if not 0 <= spec.start < spec.stop <= e.shape[spec.dim]:
        raise CheckpointError(f"shard [{spec.start}, {spec.stop}) of tensor {e.name!r} along dim "
                              f"{spec.dim} is outside [0, {e.shape[spec.dim]})",
                              source=str(e.file), hint=hint)
    return spec


_GROUPS = (
    (re.compile(r"^(.*\.)(q_proj|k_proj|v_proj)\.(weight|bias)$"), ("q_proj", "k_proj", "v_proj")),
    (re.compile(r"^(.*\.)(gate_proj|up_proj)\.(weight|bias)$"), ("gate_proj", "up_proj")),
)


def projection_groups(names: Iterable[str]) -> list[list[str]]:
    """The names of each group of projections of one input present in full (a layer's q/k/v
    weights, their biases, its gate/up weights, ...), each in product order (q, k, v; gate,
    up), groups in the order their first name appears."""
    found: dict[tuple, dict[str, str]] = {}
    for name in names:
        for i, (pattern, _order) in enumerate(_GROUPS):
            m = pattern.match(name)
            if m:
                found.setdefault((i, m.group(1), m.group(3)), {})[m.group(2)] = name
                break
    return [[members[o] for o in _GROUPS[i][1]] for (i, _p, _k), members in found.items()
            if all(o in members for o in _GROUPS[i][1])]


def placement_order(entries: Iterable[TensorEntry]) -> list[TensorEntry]:
    """``entries`` in checkpoint order, except that each :func:`projection_groups` group is
    placed together, in product order, where its first member falls (the rest of the order is
    unchanged)."""
    entries = list(entries)
    by_name = {e.name: e for e in entries}
    group_of = {n: g for g in projection_groups(by_name) for n in g}
    out: list[TensorEntry] = []
    done: set[str] = set()
    for e in entries:
        if e.name in done:
            continue
        members = group_of.get(e.name, (e.name,))
        out.extend(by_name[n] for n in members)
        done.update(members)
    return out


def plan_image(checkpoint: Checkpoint, dtype: "torch.dtype | None" = None,
               shard: ShardHook | None = None) -> WeightImage:
    """Places every tensor of ``checkpoint`` (see the module docstring)."""
    want = st_dtype_of(dtype)
    placed = []
    offset = 0
    for e in placement_order(checkpoint.entries):
        spec = shard(e.name, e.shape) if shard is not None else None
        if isinstance(spec, ShardSpec) and spec.skipped:  # not held by this worker
            continue
        spec = _check_shard(e, spec)
        shape = list(e.shape)
        if spec is not None:
            shape[spec.dim] = spec.stop - spec.start
        out = want if (want is not None and e.dtype in CONVERTIBLE) else e.dtype
        nbytes = math.prod(shape) * ITEM_BYTES[out]
        offset = -(-offset // TENSOR_ALIGN) * TENSOR_ALIGN
        placed.append(Placed(e, spec, out, tuple(shape), offset, nbytes))
        offset += nbytes
    return WeightImage(checkpoint, tuple(placed), max(offset, 1))


def zero(addr: int, nbytes: int) -> None:
    """Zeroes ``nbytes`` of host memory at ``addr``."""
    if nbytes > 0:
        C.memset(addr, 0, nbytes)
