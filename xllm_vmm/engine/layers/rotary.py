"""Rotary position embedding (RoPE), Hugging Face's "rotate half" convention.

``inv_freq[i] = 1 / theta^(2i / rotary_dim)`` for ``i < rotary_dim / 2``, optionally rescaled:

- ``default``: as is;
- ``linear``: ``inv_freq / factor``;
- ``llama3``: wavelengths longer than ``original_max_position_embeddings / low_freq_factor`` are
  divided by ``factor``, shorter than ``... / high_freq_factor`` kept, and the band between is
  interpolated smoothly (Llama 3.1's formula, as transformers implements it);
- ``yarn`` (DeepSeek-V3): frequencies blended between ``inv_freq`` and
  ``inv_freq / factor`` by a linear ramp over the dimensions whose rotations at
  ``original_max_position_embeddings`` fall between ``beta_slow`` and ``beta_fast`` (bounds
  floored/ceiled unless ``truncate`` is false), and cos/sin multiplied by the attention factor
  (``attention_factor``, else ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` with
  both given, else ``mscale(factor)``; ``mscale(s, m) = 0.1 m ln s + 1`` for ``s > 1``) —
  transformers' ``_compute_yarn_parameters``.

Angles are computed in float32 (``position * inv_freq``); cos/sin are cast to the activations'
dtype before the rotation, like transformers does, so fp32 outputs agree to rounding.
:meth:`RotaryEmbedding.apply_` rotates q and k in place in one native pass (``layer_ops.rope_``,
cos/sin rows looked up by position inside the op) when they fit it, else returns the torch
formula's new tensors (:meth:`RotaryEmbedding.__call__`); both give the same bits.
The cos/sin table starts at ``min(max_positions, INITIAL_POSITIONS)`` positions (a 128k-context
model would otherwise hold hundreds of MB of table at start) and doubles on demand.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
INITIAL_POSITIONS = 8192


class RopeConfigError(ValueError):
    """A rope configuration this engine does not implement (the message names the field)."""


def rope_parameters(config: Mapping[str, Any]) -> dict[str, Any]:
    """The rope settings of a ``config.json``: transformers 5's ``rope_parameters`` or the older
    ``rope_theta`` + ``rope_scaling`` pair, normalised to one dict with ``rope_type`` and
    ``rope_theta``."""
    params = config.get("rope_parameters")
    if isinstance(params, Mapping) and "full_attention" in params:  # per layer-type form
        params = params["full_attention"]
    if isinstance(params, Mapping):
        out = dict(params)
    else:
        out = dict(config.get("rope_scaling") or {})
        out["rope_theta"] = config.get("rope_theta", 10000.0)
    kind = out.get("rope_type") or out.get("type") or "default"
    out["rope_type"] = kind
    out.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    return out


def _yarn_mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn_factor(rope: Mapping[str, Any], max_positions: int | None) -> float:
    factor = rope.get("factor")
    if factor is None:
        try:
            factor = max_positions / float(rope["original_max_position_embeddings"])
        except (KeyError, TypeError):
            raise RopeConfigError("yarn rope scaling needs 'factor' (or "
                                  "'original_max_position_embeddings' and max_position_embeddings)"
                                  " in rope_parameters of config.json") from None
    return float(factor)


def rope_attention_factor(rope: Mapping[str, Any], max_positions: int | None = None) -> float:
    """The factor cos/sin are multiplied by (1 except for ``yarn``; see the module doc)."""
    if rope.get("rope_type") != "yarn":
        return 1.0
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    factor = _yarn_factor(rope, max_positions)
    m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
    if m and m_all:
        return _yarn_mscale(factor, float(m)) / _yarn_mscale(factor, float(m_all))
    return _yarn_mscale(factor)


def inverse_frequencies(rotary_dim: int, rope: Mapping[str, Any],
                        max_positions: int | None = None):
    """float32 ``(rotary_dim // 2,)`` inverse frequencies for the normalised ``rope`` dict
    (``max_positions``: the model's ``max_position_embeddings``, which yarn without ``factor``
    divides by ``original_max_position_embeddings``)."""
    import torch

    kind = rope["rope_type"]
    if kind not in ROPE_TYPES:
        raise RopeConfigError(f"rope_type {kind!r} is not supported (supported: "
                              f"{', '.join(ROPE_TYPES)}); set rope_parameters.rope_type in config.json")
    theta = float(rope["rope_theta"])
    inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32)
                           / rotary_dim))
    if kind == "linear":
        inv = inv / float(rope["factor"])
    elif kind == "llama3":
        try:
            factor = float(rope["factor"])
            low = float(rope["low_freq_factor"])
            high = float(rope["high_freq_factor"])
            old = float(rope["original_max_position_embeddings"])
        except KeyError as e:
            raise RopeConfigError(f"llama3 rope scaling needs field {e.args[0]!r} in "
                                  "rope_parameters (or rope_scaling) of config.json") from None
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    elif kind == "yarn":
        factor = _yarn_factor(rope, max_positions)
        try:
            old = float(rope["original_max_position_embeddings"])
        except KeyError:
            raise RopeConfigError("yarn rope scaling needs 'original_max_position_embeddings' in "
                                  "rope_parameters (or rope_scaling) of config.json") from None
        fast, slow = float(rope.get("beta_fast") or 32), float(rope.get("beta_slow") or 1)

        def correction_dim(rotations: float) -> float:
            return rotary_dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(fast), correction_dim(slow)
        if rope.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, rotary_dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(rotary_dim // 2, dtype=torch.float32) - low)
                           / (high - low), 0, 1)
        extrapolation = 1 - ramp
        inv = (inv / factor) * (1 - extrapolation) + inv * extrapolation
    return inv


class RotaryEmbedding:
    """Applies RoPE to ``q`` (T, H, D) and ``k`` (T, Hkv, D) at ``positions`` (T,) int64.

    ``rotary_dim`` = ``head_dim`` (partial rotary is not used by the supported families).
    """

    def __init__(self, head_dim: int, rope: Mapping[str, Any], max_positions: int,
                 device: Any = None) -> None:
        self.head_dim = head_dim
        self.inv_freq = inverse_frequencies(head_dim, rope, max_positions).to(device)
        self.attention_factor = rope_attention_factor(rope, max_positions)
        self.device = device
        self._cos = self._sin = None
        self._build(max(1, min(max_positions, INITIAL_POSITIONS)))

    def _build(self, n: int) -> None:
        import torch

        pos = torch.arange(n, dtype=torch.float32, device=self.device)
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        af = self.attention_factor
        self._cos, self._sin = (emb.cos(), emb.sin()) if af == 1.0 else (emb.cos() * af,
                                                                           emb.sin() * af)
        self._cast: dict = {}

    def cos_sin(self, positions: Tensor, dtype) -> tuple[Tensor, Tensor]:
        """``(T, 1, D)`` cos and sin of ``positions`` in ``dtype`` (broadcast over heads).

        The last call's result is kept and returned again for the same ``positions`` tensor
        object and dtype (every layer of a step passes the same one: one lookup per step)."""
        last = self._last
        if last is not None and last[0] is positions and last[1] == dtype:
            return last[2]
        res = self._lookup(positions, dtype)
        self._last = (positions, dtype, res)
        return res

    _last: Any = None

    def tables(self, positions: Tensor, dtype) -> tuple[Tensor, Tensor]:
        """The whole ``(P, rotary_dim)`` cos and sin tables in ``dtype``, grown to cover every
        position in ``positions`` (checked once per ``positions`` tensor object)."""
        if self._sized is not positions:
            n = int(positions.max()) + 1 if positions.numel() else 1
            if n > self._cos.shape[0]:
                self._build(max(n, 2 * self._cos.shape[0]))
            self._sized = positions
        table = self._cast.get(dtype)
        if table is None:
            table = self._cast[dtype] = (self._cos.to(dtype), self._sin.to(dtype))
        return table

    _sized: Any = None

    def _lookup(self, positions: Tensor, dtype) -> tuple[Tensor, Tensor]:
        cos, sin = self.tables(positions, dtype)
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)

    @staticmethod
    def _rotate_half(x: Tensor) -> Tensor:
        import torch

        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def __call__(self, positions: Tensor, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """The torch formula: new rotated ``q`` and ``k`` (last dimension ``rotary_dim``)."""
        cos, sin = self.cos_sin(positions, q.dtype)
        return (q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin)

    def apply_(self, positions: Tensor, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """Rotated ``q`` (T, H, D) and ``k`` (T, Hkv, D), ``D == rotary_dim``: in place (the same
        tensors are returned) when the native op takes them, else :meth:`__call__`'s. A
        non-contiguous ``q`` (a view of a fused q/k/v product) is rotated into a new contiguous
        tensor in the same pass (what attention reads: no later copy); ``k`` stays in place."""
        import torch

        from xllm_vmm.engine.layers import layer_ops

        if (q.shape[-1] == self.head_dim and k.shape[-1] == self.head_dim
                and positions.dtype is torch.int64 and positions.device.type == "cpu"
                and layer_ops.supported_heads(q, k) and positions.is_contiguous()):
            cos, sin = self.tables(positions, q.dtype)
            if q.is_contiguous():
                layer_ops.rope_(positions, q, k, cos, sin, checked=True)  # positions >= 0
                return q, k
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            layer_ops.rope_(positions, q, k, cos, sin, checked=True, q_out=out)
            return out, k
        return self(positions, q, k)
