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


BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
              "use_regex": True}
"""The ``ByteLevel`` pre-tokenizer / post-processor / decoder entry of a ``tokenizer.json``."""


def bpe_tokenizer_json(vocab: dict[str, int], merges: list[list[str]], added: list[dict],
                       pre_tokenizer: dict | None = None) -> dict:
    """A byte-level BPE ``tokenizer.json`` (the ``tokenizers`` library's format) over
    ``vocab`` and ``merges``, with ``added`` tokens; ``pre_tokenizer`` defaults to
    :data:`BYTE_LEVEL`."""
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None, "pre_tokenizer": pre_tokenizer or BYTE_LEVEL,
        "post_processor": BYTE_LEVEL, "decoder": BYTE_LEVEL,
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }


__all__ = ["BYTE_LEVEL", "bpe_tokenizer_json", "bytes_to_unicode"]
