"""Tiny Hugging Face checkpoints that the engine and server tests build themselves.

The builder itself (tokenizer, families, :func:`build_checkpoint`, :func:`deepseek_v3_checkpoint`,
:func:`load_hf_model`) lives in :mod:`xllm_vmm.bench.tiny_checkpoint` (``bench spec`` builds its
target with it from an installed wheel); this module re-exports it and adds the families'
defaults and transformers' references.

No downloads are possible here, so every reference model is made locally: a transformers config
of one of the engine's families, random fp32 weights from a fixed seed, ``save_pretrained`` with
safetensors (optionally sharded), and a small byte-level BPE tokenizer trained with ``tokenizers``
on a short text, with a chat template in ``tokenizer_config.json``.

Public helpers (all return the model directory as a :class:`pathlib.Path`):

- :func:`build_checkpoint` ``(out_dir, family, *, tie_word_embeddings=False, rope_scaling=None,
  max_shard_size=None, seed=0, dtype="float32", **config_overrides)`` — one family of
  :data:`FAMILIES`;
- :func:`llama_checkpoint`, :func:`llama3_checkpoint` (llama3 rope scaling),
  :func:`qwen2_checkpoint` (qkv bias), :func:`qwen3_checkpoint` (q/k norm),
  :func:`qwen3_moe_checkpoint` (top-k experts) — the same with that family's defaults;
- :func:`build_tokenizer` ``(out_dir)`` — only ``tokenizer.json`` + ``tokenizer_config.json``
  (+ ``special_tokens_map.json``); returns the vocabulary size.
- :func:`load_hf_model` ``(model_dir)`` — the transformers reference model, fp32, eval mode.

The invariants the tests rely on (vocabulary sizes, byte-identical weights per seed, the
widened init, the special tokens) are in :mod:`xllm_vmm.bench.tiny_checkpoint`'s docstring.
"""

from __future__ import annotations

from pathlib import Path

from xllm_vmm.bench.tiny_checkpoint import (  # noqa: F401  (re-exported for the tests)
    BOS, CHAT_TEMPLATE, CORPUS, EOS, FAMILIES, IM_END, IM_START, SPECIAL_TOKENS, TOKENIZER_VOCAB,
    _rewrite_tensors, build_checkpoint, build_tokenizer, deepseek_v3_checkpoint, load_hf_model,
    token_id)

LLAMA3_ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def llama_checkpoint(out_dir, **kw) -> Path:
    """Llama, untied by default (``tie_word_embeddings=True`` for tied)."""
    return build_checkpoint(out_dir, "llama", **kw)


def llama3_checkpoint(out_dir, **kw) -> Path:
    """Llama with llama3 rope scaling (original context 64, so long prompts see the scaling)."""
    return build_checkpoint(out_dir, "llama", rope_scaling=LLAMA3_ROPE_SCALING, **kw)


def qwen2_checkpoint(out_dir, **kw) -> Path:
    """Qwen2/2.5 (q/k/v projections with bias), tied embeddings by default like small Qwen2.5."""
    kw.setdefault("tie_word_embeddings", True)
    return build_checkpoint(out_dir, "qwen2", **kw)


def qwen3_checkpoint(out_dir, **kw) -> Path:
    """Qwen3 (per-head RMS norm on q and k; head_dim 32 != hidden/heads)."""
    return build_checkpoint(out_dir, "qwen3", **kw)


def qwen3_moe_checkpoint(out_dir, **kw) -> Path:
    """Qwen3-MoE: 8 experts, top-2, normalised top-k weights, every layer sparse."""
    return build_checkpoint(out_dir, "qwen3_moe", **kw)


def random_prompt(n: int, seed: int = 0) -> list[int]:
    """``n`` seeded token ids in [4, 384) (clear of the special tokens; inside every tiny
    checkpoint's vocabulary)."""
    import torch

    g = torch.Generator().manual_seed(seed * 1000 + n)
    return torch.randint(4, 384, (n,), generator=g).tolist()


def hf_last_logits(hf, ids: list[int]):
    """transformers' logits for the last position of ``ids`` (one forward, no cache)."""
    import torch

    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1]


def hf_greedy(model_dir_or_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by transformers ``generate`` (eos ignored: exactly max_new_tokens)."""
    import torch

    model = (load_hf_model(model_dir_or_model)
             if isinstance(model_dir_or_model, (str, Path)) else model_dir_or_model)
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             eos_token_id=None, pad_token_id=token_id(EOS))
    return out[0, len(prompt_ids):].tolist()


# --- MLA and hybrid families ------------------------------------------------------------------

def qwen3_next_checkpoint(out_dir, **kw) -> Path:
    """Qwen3-Next, 4 layers (linear, full, linear, full): Gated DeltaNet with 2 key / 4 value
    heads of 8, conv kernel 4; gated full attention 4 heads / 2 KV heads of 16 with partial
    RoPE (a quarter); every layer MoE (4 experts, top-2) with a gated shared expert."""
    kw.setdefault("num_hidden_layers", 4)
    return build_checkpoint(out_dir, "qwen3_next", **kw)


def deepseek_v32_checkpoint(out_dir, **kw) -> Path:
    """DeepSeek-V3.2: the DeepSeek-V3 shape plus a sparse-attention indexer per layer (16 heads
    of 16, top-8 keys: prompts longer than 8 tokens exercise the selection). Many index heads:
    with few, some keys score exactly 0 (every head's ReLU is 0) and the top-k order among such
    ties is arbitrary, in transformers too."""
    return build_checkpoint(out_dir, "deepseek_v32", **kw)
