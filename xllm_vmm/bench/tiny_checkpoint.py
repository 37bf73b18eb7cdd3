"""Tiny Hugging Face checkpoints built locally: the target model of ``bench spec`` and of the
engine and server tests (no downloads are possible, so every reference model is made here).

A transformers config of one of :data:`FAMILIES`, random fp32 weights from a fixed seed,
``save_pretrained`` with safetensors (optionally sharded), and a small byte-level BPE tokenizer
trained with ``tokenizers`` on a short text, with a chat template in ``tokenizer_config.json``.
Needs ``transformers`` (the test extra; never a runtime dependency of the engine).

- :func:`build_checkpoint` ``(out_dir, family, *, tie_word_embeddings=False, rope_scaling=None,
  max_shard_size=None, seed=0, dtype="float32", **config_overrides)`` — one family;
- :func:`deepseek_v3_checkpoint` — DeepSeek-V3 (MLA, MoE) with its router bias drawn and the
  residual branches optionally scaled (``bench spec``'s target);
- :func:`build_tokenizer` ``(out_dir)`` — only the tokenizer files; returns the vocabulary size;
- :func:`load_hf_model` ``(model_dir)`` — the transformers reference model, fp32, eval mode.

Invariants (the tests rely on them):

- the model's ``vocab_size`` equals the tokenizer's vocabulary size, so every token id a model
  can produce decodes;
- the same arguments give byte-identical weights (seeded ``torch.Generator``, no global RNG use);
- weights are spread wider than transformers' default init (std 0.02 gives logits so flat that
  greedy ties flip on rounding): embeddings std ``1``, other matrices and biases std ``0.3``,
  the LM head std ``0.5``, norm weights ``1 + N(0, 0.1)`` — so every parameter (norms,
  biases) shows in the output and greedy continuations of tied models do not collapse into
  repeating the last token;
- special tokens: ``<|begin_of_text|>`` (bos), ``<|end_of_text|>`` (eos of plain text),
  ``<|im_start|>``, ``<|im_end|>`` (chat turns; also an eos id in ``generation_config.json``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CORPUS = """\
The quick brown fox jumps over the lazy dog. A virtual memory pool maps physical pages on demand
and releases them when they are idle. Every block of the key value cache lives in a slot, and a
slot is one page offset across every tensor of a cache group. Large language models read the
prompt once, then decode one token at a time; the scheduler batches many requests together so the
device stays busy. Hello, world! How are you today? I am fine, thank you. Numbers: 0 1 2 3 4 5 6 7
8 9 10 100 1000 2026. Punctuation (brackets) [lists] {sets} "quotes" 'single' - dashes; colons: and
question marks? Unicode: café, naïve, Straße, 東京, 你好, emoji 🙂. def main(): return x + y * 2
"""

SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>")
BOS, EOS, IM_START, IM_END = SPECIAL_TOKENS

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TOKENIZER_VOCAB = 384

_tokenizer_cache: dict[str, str] = {}


def _tokenizer_json() -> str:
    """The trained tokenizer as JSON text (trained once per process; training is deterministic)."""
    if "json" not in _tokenizer_cache:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        trainer = trainers.BpeTrainer(
            vocab_size=TOKENIZER_VOCAB, special_tokens=list(SPECIAL_TOKENS), min_frequency=1,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train_from_iterator([CORPUS], trainer=trainer)
        _tokenizer_cache["json"] = tok.to_str()
    return _tokenizer_cache["json"]


def build_tokenizer(out_dir: str | Path) -> int:
    """Write ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``.

    Returns the vocabulary size (special tokens included; ids 0..3 are :data:`SPECIAL_TOKENS`).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = _tokenizer_json()
    (out / "tokenizer.json").write_text(text, encoding="utf-8")
    vocab = json.loads(text)["model"]["vocab"]
    added = {t["content"]: t["id"] for t in json.loads(text)["added_tokens"]}
    size = max(max(vocab.values()), max(added.values())) + 1
    decoder = {str(i): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": True} for tok, i in added.items()}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": IM_END, "pad_token": EOS, "unk_token": None,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": 4096, "chat_template": CHAT_TEMPLATE, "added_tokens_decoder": decoder,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": IM_END, "pad_token": EOS}), encoding="utf-8")
    return size


def token_id(token: str) -> int:
    """Id of a special token of the tiny tokenizer."""
    return {t["content"]: t["id"] for t in json.loads(_tokenizer_json())["added_tokens"]}[token]


_BASE: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6, hidden_act="silu",
    initializer_range=0.02,
)

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(architectures=["LlamaForCausalLM"], head_dim=16, rope_theta=10000.0),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], rope_theta=1000000.0,
                  use_sliding_window=False),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], head_dim=32, rope_theta=1000000.0,
                  use_sliding_window=False, attention_bias=False),
    "qwen3_moe": dict(architectures=["Qwen3MoeForCausalLM"], head_dim=16, rope_theta=1000000.0,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                      use_sliding_window=False, router_aux_loss_coef=0.0),
}


# MLA, hybrid linear-attention and sparse-attention families
FAMILIES["deepseek_v3"] = dict(
    architectures=["DeepseekV3ForCausalLM"], rope_theta=10000.0, num_key_value_heads=4,
    q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
    first_k_dense_replace=1, moe_intermediate_size=32, routed_scaling_factor=2.5,
    norm_topk_prob=True, rope_interleave=True)


FAMILIES["qwen3_next"] = dict(
    architectures=["Qwen3NextForCausalLM"], rope_theta=10000.0, head_dim=16,
    partial_rotary_factor=0.25, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
    full_attention_interval=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[],
    norm_topk_prob=True, router_aux_loss_coef=0.0)

FAMILIES["deepseek_v32"] = dict(FAMILIES["deepseek_v3"], architectures=["DeepseekV32ForCausalLM"],
                                index_n_heads=16, index_head_dim=16, index_topk=8)


def _config(family: str, vocab_size: int, tie: bool, rope_scaling: dict | None,
            overrides: dict[str, Any]):
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; one of {sorted(FAMILIES)}")
    kw: dict[str, Any] = {**_BASE, **FAMILIES[family], **overrides}
    arch = kw.pop("architectures")[0]
    cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    kw.update(vocab_size=vocab_size, tie_word_embeddings=tie, bos_token_id=token_id(BOS),
              eos_token_id=token_id(IM_END), pad_token_id=token_id(EOS))
    theta = kw.pop("rope_theta")
    rope = {"rope_type": "default", "rope_theta": theta}
    if rope_scaling is not None:
        rope = {**rope_scaling, "rope_theta": theta}
    kw["rope_parameters"] = rope
    cfg = cls(**kw)
    cfg.architectures = [arch]
    return cfg


def _spread_weights(model, seed: int) -> None:
    """Re-draw every parameter from a seeded generator (see the module invariants)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.startswith("lm_head"):
                p.copy_(0.5 * noise)
            elif name.endswith("embed_tokens.weight"):
                p.copy_(noise)
            else:
                p.copy_(0.3 * noise)


def build_checkpoint(out_dir: str | Path, family: str = "llama", *,
                     tie_word_embeddings: bool = False, rope_scaling: dict | None = None,
                     max_shard_size: str | int | None = None, seed: int = 0,
                     dtype: str = "float32", **config_overrides: Any) -> Path:
    """Build a tiny checkpoint of ``family`` in ``out_dir`` (created) and return ``out_dir``.

    ``max_shard_size`` (e.g. ``"40KB"``) shards the safetensors with an index file.
    ``dtype`` is the stored dtype (``"float32"`` or ``"bfloat16"``; config ``torch_dtype`` too).
    ``config_overrides`` are config fields (``num_hidden_layers=4``, ``hidden_size=...``).
    """
    import torch
    import transformers

    out = Path(out_dir)
    vocab = build_tokenizer(out)
    cfg = _config(family, vocab, tie_word_embeddings, rope_scaling, config_overrides)
    model_cls = getattr(transformers, cfg.architectures[0])
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = model_cls(cfg).to(torch.float32).eval()
    _spread_weights(model, seed)
    model = model.to(torch_dtype)
    model.config.dtype = torch_dtype
    kw: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        kw["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **kw)
    gen = {"bos_token_id": token_id(BOS), "eos_token_id": [token_id(IM_END), token_id(EOS)],
           "pad_token_id": token_id(EOS), "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out


def load_hf_model(model_dir: str | Path):
    """The transformers reference for a checkpoint built here (fp32, eval, eager attention)."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="eager").eval()


def _rewrite_tensors(model_dir: Path, edit) -> None:
    """Apply ``edit(name, tensor) -> tensor`` to every tensor of a single-file checkpoint."""
    from safetensors.torch import load_file, save_file

    path = Path(model_dir) / "model.safetensors"
    tensors = load_file(str(path))
    save_file({k: edit(k, v).contiguous() for k, v in tensors.items()}, str(path),
              metadata={"format": "pt"})


def deepseek_v3_checkpoint(out_dir, *, seed: int = 0, branch_scale: float = 1.0,
                           **kw) -> Path:
    """DeepSeek-V3: MLA (q LoRA 32, kv LoRA 32, rope 8 interleaved, nope 16, v 16), layer 0
    dense, layer 1 MoE (8 routed experts in 2 groups, top-2 from 1 group, 1 shared expert,
    scaling 2.5). The router's ``e_score_correction_bias`` (a buffer transformers leaves at 0)
    is drawn too, so the routing test sees it. ``branch_scale`` multiplies every residual
    branch's output projection (``o_proj``, ``down_proj``): below 1 the residual stream keeps
    more of the token embedding (a smoother model whose next token a draft can learn)."""
    import torch

    out = build_checkpoint(out_dir, "deepseek_v3", seed=seed, **kw)
    gen = torch.Generator().manual_seed(seed + 15)

    def edit(name, t):
        if name.endswith("e_score_correction_bias"):
            return 0.3 * torch.randn(t.shape, generator=gen, dtype=t.dtype)
        if branch_scale != 1.0 and name.endswith(("o_proj.weight", "down_proj.weight")):
            return t * branch_scale
        return t

    if kw.get("max_shard_size") is None:
        _rewrite_tensors(out, edit)
    return out


__all__ = ["BOS", "EOS", "FAMILIES", "IM_END", "IM_START", "SPECIAL_TOKENS", "build_checkpoint",
           "build_tokenizer", "deepseek_v3_checkpoint", "load_hf_model", "token_id"]
