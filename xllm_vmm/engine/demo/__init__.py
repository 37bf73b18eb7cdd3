"""The embedded demo model: ``--model demo``, and what the engine serves without ``--model``
when the default model cannot be fetched.

A tiny Llama (fp32) with a byte-level BPE tokenizer and a ChatML chat template, built on first
use from :data:`SEED` and the corpus text shipped beside this module (``corpus.md``), and cached
in ``$XDG_CACHE_HOME/xllm-vmm/`` (default ``~/.cache/xllm-vmm/``). It is not trained: its
embeddings are random, its layers nearly silent (projections of std 0.1/√fan_in), and its LM
head is written so that the logits of the next token follow the corpus's token bigrams
(``lm_head[n] = β · Σ_c C[c, n] · E[c]`` with ``C`` the bigram counts scaled to 0..16 per
row: random embeddings are nearly orthogonal, so ``lm_head · E[c]`` is about ``C[c, ·]``).
Its text is therefore corpus-like word salad — it shows the machinery (batching, the VMM
pool, streaming), not language. Anything that prints its output says it is a demo model.

Same bytes on every machine: the tokenizer is trained here by a small deterministic BPE
(pairs counted over the corpus split into words, the most frequent pair merged first, ties
broken by the pair's text), the weights come from a counter-based integer generator
(splitmix64 over uint64, wrapping arithmetic) turned into floats with exact operations only
(no ``log``/``cos``, whose last bits vary between math libraries; the LM head's sums are
integer matrix products, exact in any order, scaled once), and every file is written
by this module (JSON with sorted keys, safetensors laid out by hand). ``tests/engine/test_demo.py``
checks the SHA-256 of the files (:func:`content_hash`).

Layout of the directory: ``config.json``, ``generation_config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
import tempfile
from pathlib import Path
from xllm_vmm.models.byte_level import bpe_tokenizer_json, bytes_to_unicode

DEMO_NAME = "xllm-vmm-demo"
DEMO_VERSION = 2
"""Bump when anything below changes the files (the cache directory is per version)."""

SEED = 20251201
VOCAB_SIZE = 512
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ARCH = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
FILES = ("config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
         "tokenizer.json", "tokenizer_config.json")


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/xllm-vmm`` (default ``~/.cache/xllm-vmm``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "xllm-vmm"


def demo_model_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The demo model's directory, built there on first use (atomically: a half-built
    directory is never seen by another process)."""
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    out = root / f"{DEMO_NAME}-v{DEMO_VERSION}"
    if all((out / f).is_file() for f in FILES):
        return out
    from xllm_vmm.models.errors import CacheWriteError

    tmp = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_NAME}-", dir=root))
        build_demo_model(tmp)
        try:
            os.replace(tmp, out)
        except OSError:  # another process won the race (or a stale partial dir is there)
            if not all((out / f).is_file() for f in FILES):
                import shutil

                shutil.rmtree(out, ignore_errors=True)
                os.replace(tmp, out)
    except OSError as exc:  # a full disk, a read-only cache: one error naming the directory
        if exc.errno not in CacheWriteError.ERRNOS:
            raise
        raise CacheWriteError.of(exc, root) from None
    finally:
        if tmp is not None and tmp.exists():
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return out


def content_hash(model_dir: str | os.PathLike[str]) -> str:
    """SHA-256 over the demo files (name, then bytes, in :data:`FILES` order)."""
    h = hashlib.sha256()
    for name in FILES:
        h.update(name.encode())
        h.update((Path(model_dir) / name).read_bytes())
    return h.hexdigest()


# -- tokenizer -----------------------------------------------------------------------------


_WORD = re.compile(r"'(?:s|t|re|ve|m|ll|d)| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")


def _corpus() -> str:
    return (Path(__file__).with_name("corpus.md")).read_text(encoding="utf-8")


def train_bpe(text: str, num_merges: int) -> tuple[list[str], list[tuple[str, str]]]:
    """Byte-level BPE: (the 256 byte symbols in byte order, the merges in order)."""
    b2u = bytes_to_unicode()
    base = [b2u[b] for b in range(256)]
    words: dict[tuple[str, ...], int] = {}
    for w in _WORD.findall(text):
        key = tuple(b2u[b] for b in w.encode("utf-8"))
        words[key] = words.get(key, 0) + 1
    merges: list[tuple[str, str]] = []
    for _ in range(num_merges):
        pairs: dict[tuple[str, str], int] = {}
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] = pairs.get((a, b), 0) + c
        if not pairs:
            break
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        merges.append(best)
        joined = best[0] + best[1]
        new: dict[tuple[str, ...], int] = {}
        for w, c in words.items():
            out: list[str] = []
            i = 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(joined)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            t = tuple(out)
            new[t] = new.get(t, 0) + c
        words = new
    return base, merges


def _tokenizer_files() -> dict[str, dict]:
    base, merges = train_bpe(_corpus(), VOCAB_SIZE - 256 - len(SPECIAL_TOKENS))
    vocab: dict[str, int] = {}
    for s in base:
        vocab[s] = len(vocab)
    for a, b in merges:
        if a + b not in vocab:
            vocab[a + b] = len(vocab)
    added = []
    for t in SPECIAL_TOKENS:
        added.append({"id": len(vocab), "content": t, "single_word": False, "lstrip": False,
                      "rstrip": False, "normalized": False, "special": True})
        vocab[t] = len(vocab)
    tok = bpe_tokenizer_json({k: v for k, v in vocab.items() if k not in SPECIAL_TOKENS},
                             [[a, b] for a, b in merges], added)
    ids = {t: vocab[t] for t in SPECIAL_TOKENS}
    cfg = {
        "add_bos_token": False, "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "unk_token": None, "chat_template": CHAT_TEMPLATE,
        "model_max_length": ARCH["max_position_embeddings"], "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {str(a["id"]): {k: v for k, v in a.items() if k != "id"}
                                 for a in added},
    }
    special = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    return {"tokenizer.json": tok, "tokenizer_config.json": cfg,
            "special_tokens_map.json": special, "_ids": ids, "_vocab": {"n": len(vocab)},
            "_vocab_map": vocab, "_merges": merges}


# -- weights -------------------------------------------------------------------------------
_M64 = (1 << 64) - 1


def _uniform(stream: int, n: int):
    """``n`` floats uniform in [-1, 1) from splitmix64 of (SEED, stream, index), exactly."""
    return _uniform_int(stream, n).astype("float64") * (2.0 ** -23)


def _uniform_int(stream: int, n: int):
    """``n`` int64 uniform in [-2^23, 2^23) from splitmix64 of (SEED, stream, index)."""
    import numpy as np

    with np.errstate(over="ignore"):
        i = np.arange(n, dtype=np.uint64)
        z = np.uint64((SEED * 0x9E3779B97F4A7C15 + stream * 0xD1B54A32D192ED03) & _M64) + \
            (i + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(40)).astype(np.int64) - (1 << 23)


BIGRAM_SCALE = 16
"""Largest entry of the scaled bigram matrix ``C`` (a row's most frequent successor)."""
BIGRAM_LOGIT = 10.0
"""Logit of a row's most frequent successor (about: β · 16 · hidden / √3)."""


def bpe_encode(text: str, vocab: dict[str, int], merges: list[tuple[str, str]]) -> list[int]:
    """Byte-level BPE of ``text`` (the words of the training split; the lowest-ranked pair
    merged first, as ``tokenizers`` does)."""
    b2u = bytes_to_unicode()
    rank = {m: i for i, m in enumerate(merges)}
    out: list[int] = []
    for w in _WORD.findall(text):
        sym = [b2u[b] for b in w.encode("utf-8")]
        while len(sym) > 1:
            best = min(range(len(sym) - 1), key=lambda i: rank.get((sym[i], sym[i + 1]), 1 << 30))
            pair = (sym[best], sym[best + 1])
            if pair not in rank:
                break
            merged: list[str] = []
            i = 0
            while i < len(sym):
                if i + 1 < len(sym) and (sym[i], sym[i + 1]) == pair:
                    merged.append(sym[i] + sym[i + 1])
                    i += 2
                else:
                    merged.append(sym[i])
                    i += 1
            sym = merged
        out.extend(vocab[t] for t in sym)
    return out


BIGRAM_TOP = 4
"""Successors kept per token (the most frequent; fewer terms per LM-head row, less noise)."""


def bigram_matrix(ids: list[int], vocab_size: int):
    """``C[c, n]``, int64: for each token ``c`` its ``BIGRAM_TOP`` most frequent successors
    (ties: the smaller id) get ``ceil(BIGRAM_SCALE · count(c → n) / count(c → best))``; the
    row of a token the corpus never continues stays 0."""
    import numpy as np

    counts = np.zeros((vocab_size, vocab_size), dtype=np.int64)
    np.add.at(counts, (np.asarray(ids[:-1]), np.asarray(ids[1:])), 1)
    out = np.zeros_like(counts)
    for c in range(vocab_size):
        row = counts[c]
        if not row.any():
            continue
        order = sorted(range(vocab_size), key=lambda n: (-int(row[n]), n))[:BIGRAM_TOP]
        best = int(row[order[0]])
        for n in order:
            if row[n] > 0:
                out[c, n] = (BIGRAM_SCALE * int(row[n]) + best - 1) // best
    return out


def _tensors(tok: dict | None = None) -> dict[str, tuple[tuple[int, ...], bytes]]:
    """name → (shape, float32 little-endian bytes): embeddings uniform of std 1, projections
    uniform of std 0.1/√fan_in, norms 1 ± 0.1, the LM head from the bigrams (module doc)."""
    import numpy as np

    tok = tok or _tokenizer_files()
    a = ARCH
    h, i_sz, hd = a["hidden_size"], a["intermediate_size"], a["head_dim"]
    nh, nkv = a["num_attention_heads"], a["num_key_value_heads"]
    shapes: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (VOCAB_SIZE, h), "emb")]
    for L in range(a["num_hidden_layers"]):
        p = f"model.layers.{L}."
        shapes += [
            (p + "input_layernorm.weight", (h,), "norm"),
            (p + "self_attn.q_proj.weight", (nh * hd, h), "proj"),
            (p + "self_attn.k_proj.weight", (nkv * hd, h), "proj"),
            (p + "self_attn.v_proj.weight", (nkv * hd, h), "proj"),
            (p + "self_attn.o_proj.weight", (h, nh * hd), "proj"),
            (p + "post_attention_layernorm.weight", (h,), "norm"),
            (p + "mlp.gate_proj.weight", (i_sz, h), "proj"),
            (p + "mlp.up_proj.weight", (i_sz, h), "proj"),
            (p + "mlp.down_proj.weight", (h, i_sz), "proj"),
        ]
    shapes.append(("model.norm.weight", (h,), "norm"))
    out = {}
    emb_int = None
    for stream, (name, shape, kind) in enumerate(shapes):
        n = math.prod(shape)
        if kind == "emb":
            emb_int = _uniform_int(stream, n).reshape(shape)
            v = emb_int.astype(np.float64) * (math.sqrt(3.0) * 2.0 ** -23)
        else:
            u = _uniform(stream, n)
            v = 1.0 + 0.1 * u if kind == "norm" else u * (0.1 / math.sqrt(shape[1]) * math.sqrt(3.0))
        out[name] = (shape, v.astype("<f4").tobytes())
    # LM head: W[n] = beta * sum_c C[c, n] * u[c], u = emb_int / 2^23 (exact integer products)
    vocab = tok["_vocab_map"]
    flat = " ".join(_corpus().split())  # one space between words: no runs of blank lines
    c = bigram_matrix(bpe_encode(flat, vocab, tok["_merges"]), VOCAB_SIZE)
    # a prompt ending in whitespace (a chat template's "assistant\n") continues as after "."
    after_stop = c[vocab["."]].copy()
    for t, i in vocab.items():
        if i < VOCAB_SIZE and t and all(ch in "ĠĊĉč" for ch in t) and not c[i].any():
            c[i] = after_stop
    w_int = c.T @ emb_int                      # int64, |w| < 2^(4+23+9): exact in any order
    beta = BIGRAM_LOGIT * math.sqrt(3.0) / (BIGRAM_SCALE * h)
    w = w_int.astype(np.float64) * (beta * 2.0 ** -23)
    out["lm_head.weight"] = ((VOCAB_SIZE, h), w.astype("<f4").tobytes())
    return out


def _write_safetensors(path: Path, tensors: dict[str, tuple[tuple[int, ...], bytes]]) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    off = 0
    for name in sorted(tensors):
        shape, data = tensors[name]
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [off, off + len(data)]}
        off += len(data)
    hj = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    hj += b" " * (-len(hj) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hj)))
        f.write(hj)
        for name in sorted(tensors):
            f.write(tensors[name][1])


def _dump(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False) + "\n",
                    encoding="utf-8")


def build_demo_model(out_dir: str | os.PathLike[str]) -> Path:
    """Write the demo model's files into ``out_dir`` (created if needed)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tf = _tokenizer_files()
    ids = tf["_ids"]
    eos = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    a = ARCH
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": "float32",
        "torch_dtype": "float32", "vocab_size": VOCAB_SIZE, "hidden_size": a["hidden_size"],
        "intermediate_size": a["intermediate_size"], "num_hidden_layers": a["num_hidden_layers"],
        "num_attention_heads": a["num_attention_heads"],
        "num_key_value_heads": a["num_key_value_heads"], "head_dim": a["head_dim"],
        "hidden_act": "silu", "max_position_embeddings": a["max_position_embeddings"],
        "rms_norm_eps": a["rms_norm_eps"], "rope_theta": a["rope_theta"],
        "rope_scaling": None, "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": eos,
        "pad_token_id": ids["<|endoftext|>"], "initializer_range": 0.02, "use_cache": True,
        "attention_dropout": 0.0, "pretraining_tp": 1,
    }
    _dump(out / "config.json", config)
    _dump(out / "generation_config.json", {"eos_token_id": eos, "pad_token_id": ids["<|endoftext|>"]})
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        _dump(out / name, tf[name])
    _write_safetensors(out / "model.safetensors", _tensors(tf))
    return out


__all__ = ["DEMO_NAME", "DEMO_VERSION", "SEED", "bigram_matrix", "bpe_encode", "build_demo_model",
           "cache_root", "content_hash", "demo_model_dir", "train_bpe"]
