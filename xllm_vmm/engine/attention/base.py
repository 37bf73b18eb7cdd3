"""The attention backend interface every device implements.

A backend turns one :class:`~xllm_vmm.engine.step.StepInput` into its own metadata once per
step (:meth:`AttentionBackend.prepare`), then per layer writes the new K/V straight into their
blocks (:meth:`AttentionBackend.write_kv`, through the step's slot mapping) and computes
attention of the step's queries over every cached token of their sequences
(:meth:`AttentionBackend.attend`, through the block tables). Shapes: ``q`` ``(T, H, D)``,
``k``/``v`` ``(T, Hkv, D)``, output ``(T, H, D)``; ``T`` = tokens of the step in chunk order.

Semantics every backend keeps (checked against transformers by the tests): query ``i`` of a
chunk starting at ``start_pos`` sees keys ``0 .. start_pos + i`` of its own sequence (causal,
chunk offset included) and nothing of other sequences; scaling ``1 / sqrt(D)``; grouped-query
heads map query head ``h`` to KV head ``h // (H / Hkv)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

    from xllm_vmm.engine.attention.kv import KVGeometry, PagedKV
    from xllm_vmm.engine.step import StepInput


class AttentionBackend(ABC):
    """One implementation of paged attention over :class:`~.kv.PagedKV` views."""

    name: str = ""

    def __init__(self, geometry: KVGeometry, *, num_heads: int, num_kv_heads: int,
                 head_dim: int, device: Any) -> None:
        self.geometry = geometry
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5
        self.device = device

    @abstractmethod
    def prepare(self, step: StepInput) -> Any:
        """Per-step metadata (indices on the device) shared by every layer."""

    @abstractmethod
    def write_kv(self, kv: PagedKV, k: Tensor, v: Tensor, meta: Any) -> None:
        """Store the step's new K/V into their slots (in place, in the arena)."""

    @abstractmethod
    def attend(self, q: Tensor, k: Tensor, v: Tensor, kv: PagedKV, meta: Any) -> Tensor:
        """Attention output ``(T, H, D)``; ``k``/``v`` are the step's own new K/V (already
        written by :meth:`write_kv`), which a backend may use instead of re-reading them."""

    def workspace_bytes(self, meta: Any, elem: int) -> int:
        """Upper bound of this backend's transient bytes for one layer of the step."""
        return 0
