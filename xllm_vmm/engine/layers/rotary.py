"""Rotary position embedding (RoPE), Hugging Face's "rotate half" convention.

``inv_freq[i] = 1 / theta^(2i / rotary_dim)`` for ``i < rotary_dim / 2``, optionally rescaled:

- ``default``: as is;
- ``linear``: ``inv_freq / factor``;
- ``llama3``: wavelengths longer than ``original_max_position_embeddings / low_freq_factor`` are
  divided by ``factor``, shorter than ``... / high_freq_factor`` kept, and the band between is
  interpolated smoothly (Llama 3.1's formula, as transformers implements it).

Angles are computed in float32 (``position * inv_freq``); cos/sin are cast to the activations'
dtype before the rotation, like transformers does, so fp32 outputs agree to rounding.
The cos/sin table starts at ``min(max_positions, INITIAL_POSITIONS)`` positions (a 128k-context
model would otherwise hold hundreds of MB of table at start) and doubles on demand.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

ROPE_TYPES = ("default", "linear", "llama3")
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


def inverse_frequencies(rotary_dim: int, rope: Mapping[str, Any]):
    """float32 ``(rotary_dim // 2,)`` inverse frequencies for the normalised ``rope`` dict."""
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
    return inv


class RotaryEmbedding:
    """Applies RoPE to ``q`` (T, H, D) and ``k`` (T, Hkv, D) at ``positions`` (T,) int64.

    ``rotary_dim`` = ``head_dim`` (partial rotary is not used by the supported families).
    """

    def __init__(self, head_dim: int, rope: Mapping[str, Any], max_positions: int,
                 device: Any = None) -> None:
        self.head_dim = head_dim
        self.inv_freq = inverse_frequencies(head_dim, rope).to(device)
        self.device = device
        self._cos = self._sin = None
        self._build(max(1, min(max_positions, INITIAL_POSITIONS)))

    def _build(self, n: int) -> None:
        import torch

        pos = torch.arange(n, dtype=torch.float32, device=self.device)
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos, self._sin = emb.cos(), emb.sin()
        self._cast: dict = {}

    def cos_sin(self, positions: Tensor, dtype) -> tuple[Tensor, Tensor]:
        """``(T, 1, D)`` cos and sin of ``positions`` in ``dtype`` (broadcast over heads)."""
        n = int(positions.max()) + 1 if positions.numel() else 1
        if n > self._cos.shape[0]:
            self._build(max(n, 2 * self._cos.shape[0]))
        table = self._cast.get(dtype)
        if table is None:
            table = self._cast[dtype] = (self._cos.to(dtype), self._sin.to(dtype))
        return table[0][positions].unsqueeze(1), table[1][positions].unsqueeze(1)

    @staticmethod
    def _rotate_half(x: Tensor) -> Tensor:
        import torch

        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def __call__(self, positions: Tensor, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = self.cos_sin(positions, q.dtype)
        return (q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin)
