"""The embedded demo model: deterministic bytes, cached in the user's cache dir, served with no
model given."""

from __future__ import annotations

import time

import pytest

from xllm_vmm.engine.demo import (DEMO_NAME, DEMO_VERSION, FILES, VOCAB_SIZE, _corpus,
                                  _tokenizer_files, bigram_matrix, bpe_encode, build_demo_model,
                                  cache_root, content_hash, demo_model_dir, train_bpe)

# SHA-256 of the demo files (content_hash). A change here is a change of the demo model:
# bump DEMO_VERSION with it.
DEMO_SHA256 = "4d3700f60106518187ed7b960f38d4fb3e1c2214137f1b7b36a534241e1788a2"


def test_same_bytes_every_build(tmp_path):
    t = time.perf_counter()
    a = build_demo_model(tmp_path / "a")
    assert time.perf_counter() - t < 30  # seconds, not minutes (2 cores)
    b = build_demo_model(tmp_path / "b")
    assert content_hash(a) == content_hash(b) == DEMO_SHA256
    assert sorted(p.name for p in a.iterdir()) == sorted(FILES)


def test_cached_in_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_root() == tmp_path / "xllm-vmm"
    d = demo_model_dir()
    assert d == tmp_path / "xllm-vmm" / f"{DEMO_NAME}-v{DEMO_VERSION}"
    mtime = (d / "model.safetensors").stat().st_mtime_ns
    assert demo_model_dir() == d and (d / "model.safetensors").stat().st_mtime_ns == mtime
    assert not [p for p in (tmp_path / "xllm-vmm").iterdir() if p.name.startswith(".")]
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "xllm-vmm"


def test_bpe_merges_most_frequent_pair_first():
    base, merges = train_bpe("ab ab ab cd cd", 3)
    assert len(base) == 256
    # ("a", "b") 3 times; then three pairs twice each: the smallest text wins the tie
    # ('Ġ', the byte-level space, is U+0120, after "c")
    assert merges == [("a", "b"), ("c", "d"), ("Ġ", "ab")]


def test_tokenizer_and_model_load_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from xllm_vmm.engine.tokenizer import Tokenizer

    d = build_demo_model(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(d))
    tok = Tokenizer.from_dir(d)
    text = "Hello, how are you? 漢字 ✓"
    assert tok.encode(text) == hf.encode(text) and tok.decode(tok.encode(text)) == text
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == hf.apply_chat_template(msgs, tokenize=False,
                                                                   add_generation_prompt=True)
    assert set(tok.eos_token_ids) == {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")}
    model = AutoModelForCausalLM.from_pretrained(str(d))
    assert not model.config.tie_word_embeddings and model.config.vocab_size == 512


def test_llm_with_model_demo_serves_the_demo(tmp_path, monkeypatch):
    from tests.engine.checkpoints import hf_greedy
    from xllm_vmm import LLM, SamplingParams

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with LLM("demo", block_size=16, device_memory="128MiB") as llm:
        eng = llm.llm_engine
        assert eng.is_demo and eng.model_name == DEMO_NAME
        out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
        assert out.outputs[0].token_ids == hf_greedy(eng.model_dir, out.prompt_token_ids, 5)
        chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4, seed=0))
        assert chat[0].prompt.startswith("<|im_start|>user\nhi<|im_end|>")


def test_bpe_encode_matches_tokenizers():
    from tokenizers import Tokenizer as HFTokenizer

    tf = _tokenizer_files()
    import json

    tok = HFTokenizer.from_str(json.dumps(tf["tokenizer.json"]))
    text = _corpus()
    assert bpe_encode(text, tf["_vocab_map"], tf["_merges"]) == tok.encode(text).ids


def test_lm_head_follows_the_corpus_bigrams(tmp_path):
    """With the layers nearly silent, the next token's logits are about lm_head · E[c]: its
    argmax is the most frequent successor of c for most c whose most frequent successor is
    unique."""
    import numpy as np
    from safetensors.numpy import load_file

    d = build_demo_model(tmp_path)
    t = load_file(str(d / "model.safetensors"))
    e = t["model.embed_tokens.weight"].astype(np.float64)
    w = t["lm_head.weight"].astype(np.float64)
    tf = _tokenizer_files()
    c = bigram_matrix(bpe_encode(" ".join(_corpus().split()), tf["_vocab_map"], tf["_merges"]),
                      VOCAB_SIZE)
    h = e / np.sqrt((e ** 2).mean(axis=1, keepdims=True))
    logits = h @ w.T
    rows = [r for r in range(VOCAB_SIZE) if c[r].any() and (c[r] == c[r].max()).sum() == 1]
    assert len(rows) > 100
    hit = np.mean([logits[r].argmax() == c[r].argmax() for r in rows])
    assert hit > 0.8  # 0.85 with these bytes: random embeddings are only nearly orthogonal
