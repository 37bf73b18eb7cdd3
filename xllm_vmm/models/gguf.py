"""GGUF checkpoints: a ``.gguf`` file read as a Hugging Face model directory.

The file is read with the ``gguf`` package (llama.cpp's own reader, which memory-maps it) and
turned into what the rest of the engine already serves:

- a ``config.json`` dict from the metadata (``general.architecture`` and the
  ``{arch}.*`` hyper-parameters), so :func:`xllm_vmm.models.load_model_spec` sizes a GGUF
  model from its header alone (``plan``, ``check-config``);
- a ``tokenizer.json`` (byte-level BPE from ``tokenizer.ggml.tokens`` / ``merges``, control
  tokens as special added tokens, the pre-tokenizer named by ``tokenizer.ggml.pre``) and a
  ``tokenizer_config.json`` holding ``tokenizer.chat_template``;
- the tensors in Hugging Face naming, dequantized with ``gguf.quants.dequantize`` and written
  as ``model.safetensors`` in the compute dtype. llama.cpp stores the q/k projections of
  Llama-family attention with their rows permuted (interleaved rotary halves); the permutation
  is undone exactly (a reshape and a transpose: no arithmetic).

:func:`converted_dir` caches the converted directory under ``$XDG_CACHE_HOME/xllm-vmm/gguf/``
keyed by the file's SHA-256 and the dtype, so a second start reads safetensors and is fast.

Byte-level vocabularies get no BOS from the tokenizer (as transformers builds them, and as the
original Hugging Face tokenizers of these families do): their chat templates write the special
tokens themselves. Generation stops at ``tokenizer.ggml.eos_token_id`` and ``eot_token_id``
and at the end-of-turn control tokens llama.cpp also stops at (``<|im_end|>``,
``<|eot_id|>``, ...).

Every problem is a :class:`GgufError`: one line naming the file (and the tensor, type or
architecture) and what is supported; the reader's memory map is closed first.
"""

from __future__ import annotations

import contextlib
import gc
import glob
import hashlib
import json
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from xllm_vmm.models.byte_level import BYTE_LEVEL, bpe_tokenizer_json, bytes_to_unicode
from xllm_vmm.models.errors import CacheWriteError, ModelConfigError

ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
"""GGUF ``general.architecture`` → (Hugging Face architecture, model_type)."""


SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K")
"""Tensor types dequantized at load."""

DTYPES = ("float32", "bfloat16", "float16")

_PRE_SPLITS = {
    "llama3": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
_PRE_ALIASES = {"llama-bpe": "llama3", "llama-v3": "llama3", "smaug-bpe": "llama3",
                "dbrx": "llama3", "falcon3": "llama3", "deepseek-r1-qwen": "qwen2",
                "megrez": "qwen2"}
_PRE_BYTE_LEVEL = frozenset({None, "default", "gpt2", "gpt-2", "smollm"})
SUPPORTED_PRE_TOKENIZERS = tuple(sorted({"default", "gpt2", "smollm", *_PRE_SPLITS, *_PRE_ALIASES}))

_END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>",
                "<end_of_turn>", "<|end|>", "</s>")
"""Control tokens that end generation (llama.cpp's end-of-generation set, by text)."""

_LAYER = re.compile(r"^blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)$")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
_SKIPPED = frozenset({"rope_freqs.weight"})
"""Tensors the engine computes itself (llama.cpp stores Llama 3's rotary factors: they are
read back as the config's ``rope_scaling``)."""

CONVERTED_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                   "tokenizer_config.json", "model.safetensors")


class GgufError(ModelConfigError):
    """A GGUF file cannot be read or converted; the message names the file and what to do."""


# -- opening -------------------------------------------------------------------------------
def is_gguf_path(path: str | os.PathLike[str]) -> bool:
    """True for a ``.gguf`` file, or a directory without config.json holding ``.gguf`` files."""
    p = Path(path).expanduser()
    if p.is_file():
        return p.suffix.lower() == ".gguf"
    return p.is_dir() and not (p / "config.json").is_file() and any(p.glob("*.gguf"))


def gguf_file(path: str | os.PathLike[str]) -> Path:
    """The GGUF file ``path`` names: the file itself, or a directory's single ``.gguf``."""
    p = Path(path).expanduser()
    if p.is_dir():
        found = sorted(p.glob("*.gguf"))
        if len(found) != 1:
            raise GgufError(f"{len(found)} .gguf files in the directory", source=str(p),
                            hint="pass --model FILE.gguf to say which one")
        return found[0]
    return p


@contextlib.contextmanager
def open_gguf(path: str | os.PathLike[str]) -> Iterator[Any]:
    """A ``gguf.GGUFReader`` on ``path``; its memory map is closed when the block ends (also on
    an error, whose traceback would otherwise keep it), so nothing of the file stays mapped.
    Nothing that views the map may outlive the block: tensors are read as copies."""
    p = Path(path)
    try:
        from gguf import GGUFReader
    except ImportError:
        raise GgufError("the gguf package is not installed", source=str(p),
                        hint="pip install gguf (it comes with the cpu, cuda and npu extras)") from None
    try:
        with open(p, "rb") as fh:
            magic = fh.read(4)
    except OSError as e:
        raise GgufError(f"cannot read the file: {e.strerror or e}", source=str(p),
                        hint="check that the file exists and is readable") from None
    if magic != b"GGUF":
        raise GgufError(f"not a GGUF file (magic {magic!r}, expected b'GGUF')", source=str(p),
                        hint="pass a .gguf checkpoint or a Hugging Face model directory")
    why = None
    try:
        reader = GGUFReader(str(p), "r")
    except Exception as e:  # the reader raises ValueError / struct errors / IndexError on damage
        why = f"{type(e).__name__}: {e}"
    if why is not None:  # raised outside the handler: no traceback keeps the half-built map
        gc.collect()
        raise GgufError(f"the GGUF header cannot be read ({why}); the file is truncated or "
                        "damaged", source=str(p), hint="download the file again")
    mm = getattr(reader.data, "_mmap", None)
    try:
        yield reader
    finally:
        del reader
        gc.collect()
        if mm is not None:
            with contextlib.suppress(BufferError, ValueError):
                mm.close()


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        v = f.contents()
    except Exception:  # a damaged field: treated as absent
        return default
    return v


# -- config --------------------------------------------------------------------------------
def config_from_reader(reader: Any, path: str | os.PathLike[str], dtype: str | None = None) -> dict:
    """The Hugging Face ``config.json`` the GGUF metadata describes."""
    src = str(path)
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GgufError(f"architecture {arch!r} is not supported", source=src,
                        hint=f"supported GGUF architectures: {', '.join(sorted(ARCHITECTURES))}")
    hf_arch, model_type = ARCHITECTURES[arch]

    def need(key: str) -> Any:
        v = _field(reader, f"{arch}.{key}")
        if v is None:
            raise GgufError(f"metadata {arch}.{key} is missing", source=src,
                            hint="the file is incomplete; convert the checkpoint again")
        return v

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv = _field(reader, f"{arch}.attention.head_count_kv", heads)
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _field(reader, f"{arch}.vocab_size") or (len(tokens.data) if tokens is not None else None)
    names = {t.name for t in reader.tensors}
    if vocab is None:
        emb = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        vocab = int(emb.shape[-1]) if emb is not None else None
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    pad = _field(reader, "tokenizer.ggml.padding_token_id")
    cfg: dict[str, Any] = {
        "architectures": [hf_arch], "model_type": model_type,
        "vocab_size": int(vocab) if vocab is not None else None,
        "hidden_size": hidden, "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(kv), "head_dim": head_dim, "hidden_act": "silu",
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "rms_norm_eps": _f32(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": None, "attention_bias": "blk.0.attn_q.bias" in names, "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": int(bos) if bos is not None else None,
        "eos_token_id": eos_token_ids(reader),
        "pad_token_id": int(pad) if pad is not None else None,
        "torch_dtype": dtype or default_dtype(reader), "use_cache": True,
    }
    cfg["dtype"] = cfg["torch_dtype"]
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    if scaling == "linear" and factor:
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    elif scaling not in (None, "none"):
        raise GgufError(f"rope scaling {scaling!r} is not supported", source=src,
                        hint="GGUF files with no rope scaling or linear scaling load")
    if "rope_freqs.weight" in names:
        cfg["rope_scaling"] = _llama3_rope_scaling(reader, src, cfg)
    if model_type == "qwen2":
        cfg["attention_bias"] = True
        cfg["use_sliding_window"] = False
    if model_type == "qwen3":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in names
    return cfg


def _llama3_rope_scaling(reader: Any, src: str, cfg: dict) -> dict:
    """Llama 3's rope scaling from the ``rope_freqs`` tensor llama.cpp's converter writes (one
    factor per rotary pair, computed from ``factor``, ``low_freq_factor``, ``high_freq_factor``
    and ``original_max_position_embeddings``): the parameters whose factors are the tensor's,
    searched over the values Llama 3 checkpoints use; refused when none matches."""
    import math

    import numpy as np

    t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    if t.tensor_type.name != "F32":
        raise GgufError(f"tensor 'rope_freqs.weight' has type {t.tensor_type.name}", source=src,
                        hint="llama.cpp writes rope_freqs as F32; convert the checkpoint again")
    got = np.array(t.data, dtype=np.float64).reshape(-1)
    dim, base = cfg["head_dim"], cfg["rope_theta"]
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32).astype(np.float64) / dim))
    factor = float(got.max())
    for old in (2 ** k for k in range(4, 21)):
        for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0)):
            want = []
            for f in freqs:
                wavelen = 2 * math.pi / f
                if wavelen < old / high:
                    want.append(1.0)
                elif wavelen > old / low:
                    want.append(factor)
                else:
                    smooth = (old / wavelen - low) / (high - low)
                    want.append(1 / ((1 - smooth) / factor + smooth))
            if len(want) == len(got) and np.allclose(got, want, rtol=1e-5, atol=1e-6):
                return {"rope_type": "llama3", "factor": _f32(factor), "low_freq_factor": low,
                        "high_freq_factor": high, "original_max_position_embeddings": old}
    raise GgufError("tensor 'rope_freqs.weight' holds rotary factors that are not Llama 3's "
                    "rope scaling", source=src,
                    hint="GGUF files with no rope scaling, linear scaling or Llama 3's load")


def _f32(v: Any) -> float:
    """A float32 metadata value as the decimal it was written from (``1e-06``, not
    ``9.99999997e-07``): the shortest text that rounds to the same float32."""
    import numpy as np

    return float(str(np.float32(v)))


def eos_token_ids(reader: Any) -> list[int]:
    """The ids generation stops at (module docstring)."""
    out: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        v = _field(reader, key)
        if v is not None:
            out.append(int(v))
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    types = _field(reader, "tokenizer.ggml.token_type") or []
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty == 3 and t in _END_OF_TURN:
            out.append(i)
    return list(dict.fromkeys(out))


def default_dtype(reader: Any) -> str:
    """The dtype ``auto`` resolves to: the tensors' own for an all-F16/BF16 file; float32 for a
    quantized one of up to 2 billion parameters (the dequantized values exactly), bfloat16 above."""
    kinds = {t.tensor_type.name for t in reader.tensors if len(t.shape) > 1}
    if kinds and kinds <= {"F16"}:
        return "float16"
    if kinds and kinds <= {"BF16"}:
        return "bfloat16"
    n = sum(int(t.n_elements) for t in reader.tensors)
    return "float32" if n <= 2_000_000_000 else "bfloat16"


def read_config(path: str | os.PathLike[str]) -> dict:
    """The ``config.json`` of a GGUF file or directory, from its header (no tensor is read)."""
    f = gguf_file(path)
    with open_gguf(f) as reader:
        return config_from_reader(reader, f)


# -- tokenizer -----------------------------------------------------------------------------


def tokenizer_files(reader: Any, path: str | os.PathLike[str]) -> tuple[dict, dict]:
    """(``tokenizer.json``, ``tokenizer_config.json``) from the GGUF's tokenizer metadata."""
    src = str(path)
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise GgufError(f"tokenizer model {model!r} is not supported", source=src,
                        hint="GGUF files with a byte-level BPE vocabulary (tokenizer.ggml.model "
                             "'gpt2': Llama 3, Qwen, SmolLM, ...) load")
    pre = _field(reader, "tokenizer.ggml.pre")
    pre = _PRE_ALIASES.get(pre, pre)
    if pre in _PRE_BYTE_LEVEL:
        pre_tok: dict = BYTE_LEVEL
        if pre == "smollm":
            pre_tok = {"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": True}, BYTE_LEVEL]}
    elif pre in _PRE_SPLITS:
        pre_tok = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": _PRE_SPLITS[pre]}, "behavior": "Isolated",
             "invert": False},
            {**BYTE_LEVEL, "use_regex": False}]}
    else:
        raise GgufError(f"pre-tokenizer {pre!r} is not supported", source=src,
                        hint=f"supported tokenizer.ggml.pre: {', '.join(SUPPORTED_PRE_TOKENIZERS)}")
    tokens = list(_field(reader, "tokenizer.ggml.tokens") or [])
    types = list(_field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [m.split(" ", 1) for m in (_field(reader, "tokenizer.ggml.merges") or [])]
    if not tokens or not merges:
        raise GgufError("tokenizer.ggml.tokens or tokenizer.ggml.merges is missing", source=src,
                        hint="the file has no usable vocabulary; convert the checkpoint again")
    b2u = bytes_to_unicode()
    alphabet = set(b2u.values())
    vocab: dict[str, int] = {}
    added = []
    for i, (t, ty) in enumerate(zip(tokens, types)):
        spelled = t if set(t) <= alphabet else "".join(b2u[b] for b in t.encode("utf-8"))
        vocab.setdefault(spelled, i)
        if ty in (3, 4) and set(t) <= alphabet:
            added.append({"id": i, "content": t, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": ty == 3})
    tok = bpe_tokenizer_json(vocab, merges, added, pre_tok)

    def name(key: str) -> str | None:
        v = _field(reader, f"tokenizer.ggml.{key}")
        return tokens[int(v)] if v is not None and 0 <= int(v) < len(tokens) else None

    eos = eos_token_ids(reader)
    eos_text = next((tokens[i] for i in eos if tokens[i] in _END_OF_TURN), None) or name("eos_token_id")
    cfg = {
        "add_bos_token": False, "bos_token": name("bos_token_id"), "eos_token": eos_text,
        "pad_token": name("padding_token_id"), "unk_token": name("unknown_token_id"),
        "chat_template": _field(reader, "tokenizer.chat_template"),
        "clean_up_tokenization_spaces": False, "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": int(_field(reader, f"{_field(reader, 'general.architecture')}.context_length", 2048)),
        "added_tokens_decoder": {str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in added},
    }
    return tok, cfg


# -- tensors -------------------------------------------------------------------------------
def hf_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor (None: a tensor the engine does not load)."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = _LAYER.match(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def unpermute(w: Any, n_head: int) -> Any:
    """Undo llama.cpp's q/k row permutation (``n_head``: the heads the rows belong to):
    its converter stores head ``h``'s rows ``[even halves, odd halves]`` interleaved."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute(w: Any, n_head: int) -> Any:
    """llama.cpp's q/k row permutation (what its converter writes; :func:`unpermute` undoes it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _plan_tensors(reader: Any, path: str, cfg: dict) -> list[tuple[str, Any, tuple[int, ...]]]:
    """(hf name, reader tensor, HF shape) for each tensor to load, checked before any is read."""
    out = []
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            if t.name in _SKIPPED:
                continue
            raise GgufError(f"tensor {t.name!r} has no Hugging Face counterpart here", source=path,
                            hint=f"the {cfg['model_type']} loader knows token_embd, output_norm, "
                                 "output and blk.N.{attn_*,ffn_*} tensors")
        tname = t.tensor_type.name
        if tname not in SUPPORTED_TYPES:
            raise GgufError(f"tensor {t.name!r} has type {tname}, which is not supported",
                            source=path, hint=f"supported types: {', '.join(SUPPORTED_TYPES)}")
        shape = tuple(int(x) for x in reversed([int(s) for s in t.shape]))
        out.append((name, t, shape))
    if not any(n == "model.embed_tokens.weight" for n, _, _ in out):
        raise GgufError("tensor 'token_embd.weight' is missing", source=path,
                        hint="the file is incomplete; convert the checkpoint again")
    return out


def _dequantize(t: Any, shape: tuple[int, ...], path: str) -> Any:
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        if t.tensor_type == GGMLQuantizationType.F32:  # a copy: the map closes after reading
            a = np.array(t.data, dtype=np.float32, copy=True)
        elif t.tensor_type == GGMLQuantizationType.F16:
            a = np.asarray(t.data).astype(np.float32)
        else:
            a = dequantize(np.asarray(t.data), t.tensor_type)
        return np.ascontiguousarray(a, dtype=np.float32).reshape(shape)
    except Exception as e:  # short data (a truncated file), a shape that does not match
        raise GgufError(f"tensor {t.name!r} ({t.tensor_type.name}, shape {list(shape)}) cannot "
                        f"be read ({type(e).__name__}: {e}); the file is truncated or damaged",
                        source=path, hint="download the file again") from None


def _check_extent(reader: Any, path: str) -> None:
    """A truncated file: a tensor whose bytes run past the end (the reader maps what is there)."""
    size = len(reader.data)
    for t in reader.tensors:
        if int(t.data_offset) + int(t.n_bytes) > size:
            raise GgufError(f"tensor {t.name!r} ends at byte {int(t.data_offset) + int(t.n_bytes)} "
                            f"but the file has {size}: it is truncated", source=path,
                            hint="download the file again")


def iter_tensors(reader: Any, path: str | os.PathLike[str], cfg: dict,
                 dtype: str = "float32") -> Iterator[tuple[str, Any]]:
    """(Hugging Face name, numpy array in ``dtype`` — bfloat16 as its uint16 bit pattern) for
    each tensor in name order, dequantized one at a time."""
    src = str(path)
    _check_extent(reader, src)
    for name, t, shape in sorted(_plan_tensors(reader, src, cfg), key=lambda p: p[0]):
        yield name, _to_dtype(_load(t, name, shape, cfg, src), dtype)


def _load(t: Any, name: str, shape: tuple[int, ...], cfg: dict, src: str) -> Any:
    a = _dequantize(t, shape, src)
    if cfg["model_type"] == "llama" and name.endswith("self_attn.q_proj.weight"):
        a = unpermute(a, cfg["num_attention_heads"])
    elif cfg["model_type"] == "llama" and name.endswith("self_attn.k_proj.weight"):
        a = unpermute(a, cfg["num_key_value_heads"])
    return a


def _to_dtype(a: Any, dtype: str) -> Any:
    import numpy as np

    if dtype == "float32":
        return a
    if dtype == "float16":
        return a.astype(np.float16)
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)  # bfloat16: round to nearest even
    with np.errstate(over="ignore"):
        r = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = np.isnan(a)
    r = r.astype(np.uint16)
    if nan.any():
        r[nan] = 0x7FC0
    return r


_ST_DTYPE = {"float32": ("F32", 4), "float16": ("F16", 2), "bfloat16": ("BF16", 2)}


def convert(path: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, dtype: str | None = None,
            progress: Callable[[int, int], None] | None = None) -> Path:
    """Write the Hugging Face directory of GGUF ``path`` into ``out_dir``: config,
    generation config, tokenizer files, and ``model.safetensors`` in ``dtype`` (None: the
    file's :func:`default_dtype`). ``progress(done, total)`` counts tensors."""
    f = gguf_file(path)
    src = str(f)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open_gguf(f) as reader:
        dt = dtype or default_dtype(reader)
        if dt not in DTYPES:
            raise GgufError(f"dtype {dt!r} is not supported for conversion", source=src,
                            hint=f"use one of {', '.join(DTYPES)}")
        cfg = config_from_reader(reader, f, dt)
        tok, tok_cfg = tokenizer_files(reader, f)
        plan = _plan_tensors(reader, src, cfg)
        _check_extent(reader, src)
        st, size = _ST_DTYPE[dt]
        header: dict[str, Any] = {"__metadata__": {"format": "pt", "source": "gguf"}}
        off = 0
        for name, _, shape in sorted(plan, key=lambda p: p[0]):
            n = 1
            for s in shape:
                n *= s
            header[name] = {"dtype": st, "shape": list(shape), "data_offsets": [off, off + n * size]}
            off += n * size
        hj = json.dumps(header, separators=(",", ":")).encode()
        hj += b" " * (-len(hj) % 8)
        total = len(plan)
        with open(out / "model.safetensors", "wb") as fh:
            fh.write(struct.pack("<Q", len(hj)))
            fh.write(hj)
            for done, (_, a) in enumerate(iter_tensors(reader, f, cfg, dt), 1):
                fh.write(a.tobytes())
                if progress is not None:
                    progress(done, total)
    _dump(out / "config.json", cfg)
    gen = {"eos_token_id": cfg["eos_token_id"]}
    if cfg.get("bos_token_id") is not None:
        gen["bos_token_id"] = cfg["bos_token_id"]
    if cfg.get("pad_token_id") is not None:
        gen["pad_token_id"] = cfg["pad_token_id"]
    _dump(out / "generation_config.json", gen)
    _dump(out / "tokenizer.json", tok)
    _dump(out / "tokenizer_config.json", tok_cfg)
    return out


def _dump(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# -- the cache -----------------------------------------------------------------------------
def cache_root() -> Path:
    """Where converted GGUF checkpoints live: ``$XDG_CACHE_HOME/xllm-vmm/gguf``."""
    from xllm_vmm.engine.demo import cache_root as root

    return root() / "gguf"


def sha256_file(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _resolve_dtype(f: Path, dtype: str | None) -> str:
    if dtype in (None, "auto"):
        with open_gguf(f) as reader:
            return default_dtype(reader)
    aliases = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
               "half": "float16"}
    name = str(dtype).lower().removeprefix("torch.")
    d = aliases.get(name, name)
    if d not in DTYPES:
        raise GgufError(f"dtype {dtype!r} is not supported", source=str(f),
                        hint=f"use auto or one of {', '.join(DTYPES)}")
    return d


def converted_dir(path: str | os.PathLike[str], *, dtype: str | None = None,
                  cache_dir: str | os.PathLike[str] | None = None,
                  progress: Callable[[int, int], None] | None = None,
                  sha256: str | None = None, name: str | None = None) -> Path:
    """The cached Hugging Face directory of GGUF ``path`` in ``dtype`` (None/"auto": the
    file's :func:`default_dtype`), converted on first use (atomically: another process never
    sees a half-written directory). ``sha256``: the file's, when the caller knows it;
    ``name``: the name the model is served under (:func:`served_name`; default the file's stem)."""
    f = gguf_file(path)
    digest = sha256 or sha256_file(f)
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    auto = dtype in (None, "auto")
    if auto:  # the file's default dtype, as recorded by an earlier conversion: no header read
        for d in sorted(root.glob(f"{glob.escape(f.stem)}-{digest[:16]}-*")):
            if (d / "gguf_source.json").is_file() and all((d / n).is_file() for n in CONVERTED_FILES):
                with contextlib.suppress(OSError, ValueError):
                    if json.loads((d / "gguf_source.json").read_text(encoding="utf-8")).get("default"):
                        return d
    dt = _resolve_dtype(f, dtype)
    out = root / f"{f.stem}-{digest[:16]}-{dt}"
    if all((out / n).is_file() for n in CONVERTED_FILES):
        return out
    tmp = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=root))
        convert(f, tmp, dtype=dt, progress=progress)
        with open_gguf(f) as reader:
            default = default_dtype(reader) == dt
        _dump(tmp / "gguf_source.json", {"file": str(f), "sha256": digest, "dtype": dt,
                                         "default": default, "name": name or f.stem})
        try:
            os.replace(tmp, out)
        except OSError:  # another process won the race, or a stale partial directory is there
            if not all((out / n).is_file() for n in CONVERTED_FILES):
                shutil.rmtree(out, ignore_errors=True)
                os.replace(tmp, out)
    except OSError as exc:  # a full disk, a read-only cache: one error naming the directory
        if exc.errno not in CacheWriteError.ERRNOS:
            raise
        raise CacheWriteError.of(exc, root) from None
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def served_name(model_dir: str | os.PathLike[str]) -> str | None:
    """The model name of a converted directory (the GGUF's, not the cache key), else None."""
    meta = Path(model_dir) / "gguf_source.json"
    try:
        return str(json.loads(meta.read_text(encoding="utf-8"))["name"]) if meta.is_file() else None
    except (OSError, ValueError, KeyError):
        return None


def cached_conversions(cache_dir: str | os.PathLike[str] | None = None) -> list[dict]:
    """What :func:`converted_dir` has cached: ``{"dir", "file", "sha256", "dtype", "bytes"}``."""
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    out = []
    for d in sorted(root.glob("*")) if root.is_dir() else []:
        meta = d / "gguf_source.json"
        if d.name.startswith(".") or not meta.is_file():
            continue
        try:
            info = json.loads(meta.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        size = sum(p.stat().st_size for p in d.iterdir() if p.is_file())
        out.append({"dir": str(d), **info, "bytes": size})
    return out


__all__ = ["ARCHITECTURES", "GgufError", "SUPPORTED_TYPES", "cached_conversions", "config_from_reader",
           "convert", "converted_dir", "default_dtype", "gguf_file", "hf_name", "is_gguf_path",
           "iter_tensors", "open_gguf", "permute", "read_config", "tokenizer_files", "unpermute"]
