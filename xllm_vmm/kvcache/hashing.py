"""Prefix-cache block hashes: a chain of XXH3-128 hashes over complete blocks (PC-01).

The hash of block ``i`` of a request is::

    h_i = XXH3_128(seed, h_{i-1} (its canonical 16-byte digest, big endian; 16 zero bytes
                                 for i = 0)
                         || token ids of block i (uint32, little endian, block_size of them)
                         || for each medium that overlaps block i, in prompt order:
                              b"M" || its hash bytes || its start and length (uint64 LE)
                         || for i = 0 only: the request's extra key bytes)

so a hash names the whole prefix up to and including its block: two requests share block ``i``
only if they share tokens ``[0, (i + 1) * block_size)``, every medium overlapping that range,
and the extra keys (adapter name, cache salt — anything else that changes the KV content).
Putting the extra keys in block 0 is enough because every later hash chains over it.

Only *complete* blocks get a hash: a trailing partial block has none, and chunked prefill
publishes a block only once all ``block_size`` of its tokens are in the cache (PC-01).

The seed is the ``xxh3_128bits_seed`` flag (default 1024), the same token and multimodal hash
the physical KV cache uses. Hashes are ``int`` (128 bits, ``== xxh3_128_intdigest``), cheap
dict keys; the chain itself runs over the digest bytes (no int conversion inside the loop).

Units: tokens for positions and lengths; ``block_size`` in tokens per block.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from dataclasses import dataclass
from typing import Iterable, Sequence

import xxhash

BlockHash = int
"""A 128-bit prefix hash of one complete block (and, through the chain, of everything before it)."""

DEFAULT_SEED = 1024  # the xxh3_128bits_seed flag's default
_MAX_TOKEN = 0xFFFFFFFF
_ZERO16 = bytes(16)


@dataclass(frozen=True)
class MediaSpan:
    """One multimodal item (image, audio clip, ...) in a prompt: it covers the token positions
    ``[offset, offset + length)`` (placeholder tokens) and has a content hash (the processor's
    hash of the media bytes). Every block overlapping the span folds ``hash`` into its key."""

    offset: int  # tokens
    length: int  # tokens
    hash: bytes | str

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length <= 0:
            raise ValueError(
                f"MediaSpan(offset={self.offset}, length={self.length}): offset must be >= 0 and "
                "length > 0 (token positions of the media placeholder)")

    def key_bytes(self) -> bytes:
        h = self.hash.encode() if isinstance(self.hash, str) else bytes(self.hash)
        return b"M" + h + self.offset.to_bytes(8, "little") + self.length.to_bytes(8, "little")


def _extra_bytes(extra_keys: Sequence[bytes | str | int] | None) -> bytes:
    if not extra_keys:
        return b""
    out = bytearray()
    for k in extra_keys:
        if isinstance(k, int):
            kb = b"I" + k.to_bytes(16, "little", signed=True)
        elif isinstance(k, str):
            kb = b"S" + k.encode()
        else:
            kb = b"B" + bytes(k)
        out += len(kb).to_bytes(4, "little") + kb
    return bytes(out)


def request_extra_keys(*, cache_salt: str | None = None, lora: str | int | None = None
                       ) -> tuple[str, ...]:
    """The extra hash keys of a request (folded into its block 0, see the module docstring):
    the adapter it runs with (``lora``: the LoRA name or id; ``None`` = the base model) and
    vLLM's ``cache_salt`` (requests with different salts never share a block; ``None`` = no
    salt). Each key is tagged with what it is, so a salt never collides with an adapter of the
    same name. ``()`` when neither is given: the plain token hash."""
    keys: list[str] = []
    if lora is not None:
        if isinstance(lora, bool) or not isinstance(lora, (str, int)):
            raise ValueError(f"lora={lora!r}: the adapter's name (str) or id (int)")
        keys.append(f"lora:{lora}")
    if cache_salt is not None:
        if not isinstance(cache_salt, str) or not cache_salt:
            raise ValueError(f"cache_salt={cache_salt!r}: a non-empty string (vLLM's request "
                             "field) or None")
        keys.append(f"salt:{cache_salt}")
    return tuple(keys)


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as uint32 little endian. A negative id or one above 2**32-1 is refused."""
    try:
        arr = array("I", token_ids)
    except OverflowError:
        bad = next(t for t in token_ids if not 0 <= t <= _MAX_TOKEN)
        raise ValueError(f"token id {bad} is outside 0..{_MAX_TOKEN} (uint32); "
                         "prefix hashing needs vocabulary ids") from None
    if arr.itemsize != 4:  # pragma: no cover - every supported platform has a 4-byte unsigned int
        arr = array("L", token_ids)
    b = arr.tobytes()
    if sys.byteorder != "little":  # pragma: no cover
        a2 = array("I", b)
        a2.byteswap()
        b = a2.tobytes()
    return b


def _media_keys_per_block(media: Sequence[MediaSpan], n_blocks: int, block_size: int,
                          first_block: int = 0) -> dict[int, bytes]:
    keys: dict[int, bytearray] = {}
    for m in media:
        lo = m.offset // block_size
        hi = (m.offset + m.length - 1) // block_size
        for b in range(max(lo, first_block), min(hi, first_block + n_blocks - 1) + 1):
            keys.setdefault(b, bytearray()).extend(m.key_bytes())
    return {b: bytes(v) for b, v in keys.items()}


def hash_block(parent: BlockHash | None, tokens: bytes, extra: bytes = b"",
               seed: int = DEFAULT_SEED) -> BlockHash:
    """One link of the chain. ``tokens`` are uint32 LE bytes (see :func:`token_bytes`)."""
    pb = _ZERO16 if parent is None else parent.to_bytes(16, "big")
    return xxhash.xxh3_128_intdigest(pb + tokens + extra, seed)


def chain_digests(buf: bytes | memoryview, block_size: int, *, seed: int = DEFAULT_SEED,
                  parent: bytes = _ZERO16, first_block: int = 0,
                  extra: dict[int, bytes] | None = None) -> list[bytes]:
    """The XXH3-128 chain over ``buf`` (uint32 LE token ids, whole blocks only), as 16-byte
    digests. ``extra[b]`` is appended to block ``b``'s input (media, extra keys)."""
    mv = memoryview(buf)
    step = block_size * 4
    n = len(mv) // step
    digest = xxhash.xxh3_128_digest
    out: list[bytes] = []
    h = parent
    if not extra:
        for i in range(n):
            h = digest(h + mv[i * step:(i + 1) * step], seed)
            out.append(h)
        return out
    for i in range(n):
        data = h + mv[i * step:(i + 1) * step]
        e = extra.get(first_block + i)
        if e:
            data += e
        h = digest(data, seed)
        out.append(h)
    return out


def sha256_chain_digests(buf: bytes | memoryview, block_size: int) -> list[bytes]:
    """The same chain with SHA-256 (the common default elsewhere): the benchmark's baseline."""
    mv = memoryview(buf)
    step = block_size * 4
    n = len(mv) // step
    sha = hashlib.sha256
    out: list[bytes] = []
    h = bytes(32)
    for i in range(n):
        h = sha(h + mv[i * step:(i + 1) * step]).digest()
        out.append(h)
    return out


def block_hashes(token_ids: Sequence[int], block_size: int, *, seed: int = DEFAULT_SEED,
                 media: Sequence[MediaSpan] = (), extra_keys: Sequence[bytes | str | int] = (),
                 parent: BlockHash | None = None, first_block: int = 0) -> list[BlockHash]:
    """Hashes of every complete block of ``token_ids`` (``len // block_size`` of them).

    ``first_block``/``parent`` continue a chain: ``token_ids`` then starts at block
    ``first_block`` of the request and ``parent`` is the hash of block ``first_block - 1``.
    Extra keys are folded into block 0 only (see the module docstring).
    """
    if block_size <= 0:
        raise ValueError(f"block_size={block_size}: must be a positive number of tokens "
                         "(the block_size flag)")
    if (parent is None) != (first_block == 0):
        raise ValueError("continue a chain with both first_block > 0 and the parent hash, "
                         "or start it with neither")
    n = len(token_ids) // block_size
    if n == 0:
        return []
    buf = token_bytes(token_ids[: n * block_size])
    extra = _media_keys_per_block(media, n, block_size, first_block) if media else {}
    extra0 = _extra_bytes(extra_keys)
    if extra0 and first_block == 0:
        extra[0] = extra.get(0, b"") + extra0
    pb = _ZERO16 if parent is None else parent.to_bytes(16, "big")
    frombytes = int.from_bytes
    return [frombytes(d, "big") for d in chain_digests(
        buf, block_size, seed=seed, parent=pb, first_block=first_block, extra=extra)]


def sha256_block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """SHA-256 chain digests of every complete block (the benchmark's baseline)."""
    n = len(token_ids) // block_size
    return sha256_chain_digests(token_bytes(token_ids[: n * block_size]), block_size)


class RequestHasher:
    """The growing hash chain of one request: call :meth:`extend` as tokens arrive (prompt
    chunks, then generated tokens); :attr:`hashes` holds one hash per *complete* block so far.

    Invariant: ``len(hashes) == num_tokens // block_size`` and ``hashes`` equals
    ``block_hashes(all tokens so far, ...)`` — appending never rehashes earlier blocks.
    """

    def __init__(self, block_size: int, *, seed: int = DEFAULT_SEED,
                 media: Sequence[MediaSpan] = (), extra_keys: Sequence[bytes | str | int] = (),
                 token_ids: Iterable[int] = ()) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size={block_size}: must be a positive number of tokens")
        self.block_size = block_size
        self.seed = seed
        self.media = tuple(media)
        self.extra_keys = tuple(extra_keys)
        self.hashes: list[BlockHash] = []
        self._pending: list[int] = []
        self.num_tokens = 0
        self.extend(token_ids)

    def extend(self, token_ids: Iterable[int]) -> list[BlockHash]:
        """Add tokens; return the hashes of the blocks they completed (possibly none)."""
        toks = list(token_ids)
        self.num_tokens += len(toks)
        self._pending.extend(toks)
        n = len(self._pending) // self.block_size
        if n == 0:
            return []
        take = n * self.block_size
        new = block_hashes(
            self._pending[:take], self.block_size, seed=self.seed, media=self.media,
            extra_keys=self.extra_keys, parent=self.hashes[-1] if self.hashes else None,
            first_block=len(self.hashes))
        del self._pending[:take]
        self.hashes.extend(new)
        return new
