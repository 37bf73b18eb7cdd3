"""GPT-2's byte-level alphabet: the byte → printable character map that the ``ByteLevel``
pre-tokenizer of ``tokenizers`` applies, so that a byte-level BPE vocabulary (the demo model's,
a GGUF file's) is written in the characters its merges refer to."""

from __future__ import annotations


def bytes_to_unicode() -> dict[int, str]:
    """Each byte 0..255 to one printable character: the printable Latin-1 bytes map to
    themselves, the others to the code points from 256 on, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


__all__ = ["bytes_to_unicode"]
