"""A GGUF written by the ``gguf`` package's writer from a tiny Hugging Face checkpoint, laid out
as llama.cpp's converter lays it out: metadata keys, the byte-level vocabulary (special tokens
as control tokens), merges, GGUF tensor names, and the q/k rows of Llama attention permuted."""

from __future__ import annotations

import json
from pathlib import Path

ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    mod, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_NAMES[mod]}.{kind}"


def write_gguf(src: Path, path: Path, qtype: str = "F32", *, arch: str | None = None,
               pre: str = "gpt2") -> Path:
    """``src`` (a tiny checkpoint) as the GGUF ``path``: 2-D weights in ``qtype``, norms and
    biases in F32 (as llama.cpp writes them)."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    from xllm_vmm.models.gguf import permute

    cfg = json.loads((src / "config.json").read_text())
    arch = arch or ARCH[cfg["architectures"][0]]
    w = gguf.GGUFWriter(str(path), arch)
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    w.add_value_length(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    w.add_rope_freq_base(rope)
    w.add_vocab_size(cfg["vocab_size"])
    tok = json.loads((src / "tokenizer.json").read_text())
    tcfg = json.loads((src / "tokenizer_config.json").read_text())
    ids = dict(tok["model"]["vocab"])
    special = {a["content"]: a["id"] for a in tok["added_tokens"]}
    ids.update(special)
    tokens = [""] * cfg["vocab_size"]
    types = [gguf.TokenType.NORMAL] * cfg["vocab_size"]
    for t, i in ids.items():
        tokens[i] = t
        if t in special:
            types[i] = gguf.TokenType.CONTROL
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(special[tcfg["bos_token"]])
    w.add_eos_token_id(special[tcfg["eos_token"]])
    w.add_pad_token_id(special[tcfg["pad_token"]])
    w.add_add_bos_token(False)
    w.add_chat_template(tcfg["chat_template"])
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    qt = getattr(gguf.GGMLQuantizationType, qtype)
    for name in sorted(tensors):
        a = tensors[name].astype(np.float32)
        if arch == "llama" and name.endswith("q_proj.weight"):
            a = permute(a, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            a = permute(a, kv)
        if a.ndim == 2 and qtype != "F32":
            q = gguf.quants.quantize(a, qt)
            w.add_tensor(gguf_name(name), q, raw_shape=q.shape, raw_dtype=qt)
        else:
            w.add_tensor(gguf_name(name), a)
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if scaling.get("rope_type") == "llama3":  # llama.cpp's converter: one factor per rotary pair
        w.add_tensor("rope_freqs.weight", _llama3_factors(scaling, rope, cfg.get("head_dim") or
                                                          cfg["hidden_size"] // heads))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _llama3_factors(s: dict, base: float, dim: int):
    import math

    import numpy as np

    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    out = []
    for f in 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)):
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)
