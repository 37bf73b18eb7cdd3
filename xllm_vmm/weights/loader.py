"""``load_weights``: a safetensors checkpoint -> :class:`~xllm_vmm.weights.ModelWeights`.

- ``pool=None``: plain CPU tensors (no weight VMM; sleep, wakeup and fork are refused, W-02).
- ``pool`` given: one region of the pool's weights tenant (high end of the arena), mapped in
  one batched call; every tensor views it at a fixed offset. The checkpoint is read into the
  host copy (``keep_host_copy=True``: pinned host memory from the driver, kept for light-sleep
  wakeups) and copied host-to-device in batched copies of up to 64 MiB per entry; without a
  host copy it streams through a staging buffer. On any failure nothing stays allocated.

``shard(name, shape)`` returns the :class:`~xllm_vmm.weights.checkpoint.ShardSpec` a worker
loads of that tensor (tensor parallelism), or ``None`` for the whole tensor. ``dtype``
converts floating-point tensors (the loaded bytes are then torch's conversion of the file's;
without ``dtype`` they are the file's own bytes). ``progress(done_bytes, total_bytes)`` is
called with ``(0, total)`` first, after every tensor, and with ``(total, total)`` once every
byte is in place; the CLI turns it into a progress bar.

Beyond the plain load/sleep/wake interface: none in the signature; sleep also
takes ``busy=`` (running requests, the engine's count) and returns a
:class:`~xllm_vmm.weights.model_weights.SleepReport` with ``host_bytes_freed`` and ``level``
beside ``bytes_freed`` and ``seconds``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable

from xllm_vmm.weights.checkpoint import ShardHook, read_checkpoint, torch_dtype
from xllm_vmm.weights.image import plan_image
from xllm_vmm.weights.model_weights import ModelWeights

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from xllm_vmm.pool.pool import VmmPool

__all__ = ["load_weights", "region_bytes"]


def region_bytes(model_dir: str | os.PathLike, *, page_bytes: int,
                 dtype: "torch.dtype | None" = None, shard: ShardHook | None = None) -> int:
    """Bytes of pool region ``load_weights`` will take for this checkpoint: the tensors at
    their 512-byte aligned offsets, rounded up to whole pages of ``page_bytes``. Reads the
    safetensors headers only (no tensor data, no torch unless ``dtype`` is given), so callers
    can size the arena exactly before loading."""
    if page_bytes <= 0:
        raise ValueError(f"page_bytes must be positive, got {page_bytes}")
    image = plan_image(read_checkpoint(model_dir), dtype, shard)
    return -(-image.nbytes // page_bytes) * page_bytes


def load_weights(model_dir: str | os.PathLike, *, pool: "VmmPool | None" = None,
                 dtype: "torch.dtype | None" = None, shard: ShardHook | None = None,
                 progress: Callable[[int, int], None] | None = None,
                 keep_host_copy: bool = True) -> ModelWeights:
    """Loads the checkpoint in ``model_dir`` (see the module docstring)."""
    check = check_finite_wanted()  # a malformed setting is refused before anything is read
    checkpoint = read_checkpoint(model_dir)
    image = plan_image(checkpoint, dtype, shard)
    if pool is None:
        weights = _load_plain(image, progress)
    else:
        from xllm_vmm.weights.store import WeightStore

        store = WeightStore(pool, image, keep_host_copy=keep_host_copy)
        store.load(progress)
        weights = ModelWeights(store.tensors, checkpoint, store=store)
    if check:
        try:
            _check_finite(weights, model_dir)
        except BaseException:
            weights.close()  # nothing stays allocated
            raise
    return weights


CHECK_ENV = "XLLM_VMM_CHECK_WEIGHTS"
"""``finite`` (or ``1``/``true``): every floating-point tensor is checked for NaN and inf as it
loads, and the first that holds one stops the load naming it; ``0``/``false``/unset: not
checked (a pass over every weight, about as long as reading them from the page cache)."""


def check_finite_wanted(env: "dict[str, str] | None" = None) -> bool:
    """Whether :data:`CHECK_ENV` asks for the load-time check; ``ValueError`` naming the
    variable for another value."""
    value = (os.environ if env is None else env).get(CHECK_ENV, "").strip().lower()
    if value in ("", "0", "false", "off", "no"):
        return False
    if value in ("finite", "1", "true", "on", "yes"):
        return True
    raise ValueError(f"{CHECK_ENV}={value!r}: give finite (check every weight for NaN and "
                     "inf at load) or 0")


def _check_finite(weights: ModelWeights, model_dir) -> None:
    import torch

    from xllm_vmm.weights.errors import CheckpointError

    for name, t in weights.items():
        if not t.is_floating_point():
            continue
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            nan = int(torch.isnan(t).sum())
            raise CheckpointError(
                f"tensor {name!r} holds {int(bad.sum())} non-finite value(s) ({nan} NaN) of "
                f"{t.numel()}", source=str(model_dir),
                hint=f"the checkpoint is corrupt or was saved from a diverged run: re-download "
                     f"or re-export it ({CHECK_ENV}=0 serves it unchecked)")


def _load_plain(image, progress) -> ModelWeights:
    import torch

    total = image.tensor_bytes
    done = [0]

    def tick(n: int) -> None:
        done[0] += n
        if progress is not None:
            progress(done[0], total)

    if progress is not None:
        progress(0, total)
    tensors = {}
    for p in image.placed:
        t = torch.empty(p.shape, dtype=torch_dtype(p.dtype))
        image.fill(t.data_ptr(), [p], base=p.offset, progress=tick)
        tensors[p.name] = t
    if progress is not None:
        progress(total, total)
    return ModelWeights(tensors, image.checkpoint)
