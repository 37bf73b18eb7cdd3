"""Torch tensors that view a virtual range of a driver's arena, without a copy.

``view(driver, va, nbytes, dtype, shape)`` returns a tensor over ``[va, va + nbytes)``:

* host driver and the ACL emulation (host memory): a CPU tensor through ``torch.frombuffer``
  over a ctypes array at ``va``;
* CUDA: a ``cuda:<index>`` tensor through ``__cuda_array_interface__`` (needs numpy);
* a real NPU: ``torch_npu._C._construct_storage_from_data_pointer`` + ``Tensor.set_`` (the path
  the reference describes; **untested on hardware**).

Ownership, the rule every caller relies on: the *driver* owns the reservation, the handles and
the mappings; a view owns none of them. Each host/CUDA view keeps a small owner object alive
(every tensor derived from the view — slices, reshapes, dtype views — shares its storage and so
keeps the owner too), and the driver's :class:`~xllm_vmm.vmm.views.ViewRegistry` refuses to
release the reservation, or to close the driver, while an owner over it is alive
(:class:`~xllm_vmm.vmm.driver.VmmBusy`). Pages under a live view may be unmapped and re-mapped:
touching an unmapped page through a view is a bug of the caller (SIGSEGV on the host, an illegal
address on a device), which is why memory of a block is only read or written while every page
under it is mapped. NPU views are not tracked (the storage is non-owning): drop them before
releasing.
"""

from __future__ import annotations

import ctypes as C
import errno
import math
from typing import TYPE_CHECKING, Sequence

from xllm_vmm.vmm.driver import VmmInvalidArgument

if TYPE_CHECKING:  # pragma: no cover
    import torch


class _CudaArray:
    """Owner object exposing ``__cuda_array_interface__`` for one device range."""

    def __init__(self, va: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (va, False),
                                         "strides": None, "version": 2}


def _host_owner(va: int, nbytes: int):
    array_type = C.c_uint8 * nbytes
    owner_type = type("ArenaBytes", (array_type,), {})  # a subclass so weak references work
    return owner_type.from_address(va)


def view(driver, va: int, nbytes: int, dtype: "torch.dtype", shape: Sequence[int] | None = None) -> "torch.Tensor":
    """A tensor of ``dtype`` and ``shape`` (1-D when None) over ``[va, va+nbytes)``; ``nbytes``
    must equal the shape's element count × the dtype's item size."""
    import torch

    itemsize = torch.empty((), dtype=dtype).element_size()
    if nbytes <= 0 or nbytes % itemsize:
        raise VmmInvalidArgument("tensor view", errno.EINVAL, "",
                                 f"{nbytes} bytes is not a positive multiple of {dtype}'s item size {itemsize}")
    numel = nbytes // itemsize
    shape = tuple(shape) if shape is not None else (numel,)
    if math.prod(shape) != numel:
        raise VmmInvalidArgument("tensor view", errno.EINVAL, "",
                                 f"shape {shape} holds {math.prod(shape)} elements but {nbytes} bytes of "
                                 f"{dtype} hold {numel}")
    kind = getattr(driver, "device_kind", "")
    emulated = getattr(driver, "emulated", False)
    if kind == "cpu" or emulated:
        owner = _host_owner(va, nbytes)
        t = torch.frombuffer(owner, dtype=torch.uint8)
    elif kind == "cuda":
        owner = _CudaArray(va, nbytes)
        t = torch.as_tensor(owner, device=f"cuda:{driver.device_index}")
    elif kind == "npu":
        import torch_npu  # noqa: F401  (untested on hardware)

        device = torch.device("npu", driver.device_index)
        storage = torch_npu._C._construct_storage_from_data_pointer(va, device, nbytes)
        t = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (nbytes,), (1,))
        return t.view(dtype).view(shape)
    else:
        raise VmmInvalidArgument("tensor view", errno.EINVAL, "", f"no tensor view for device kind {kind!r}")
    driver.views.register(owner, va, nbytes)
    return t.view(dtype).view(shape)
