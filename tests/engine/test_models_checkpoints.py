"""The tiny checkpoint builders: loadable by transformers, deterministic, tokenizer round-trips."""

import hashlib
import json

import pytest

from tests.engine import checkpoints as C


def _digest(d):
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(d.glob("*.safetensors")))).hexdigest()


@pytest.mark.parametrize("family", sorted(C.FAMILIES))
def test_family_loads_in_transformers(tmp_path, family):
    d = C.build_checkpoint(tmp_path / family, family)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["vocab_size"] == C.build_tokenizer(tmp_path / "tok")
    model = C.load_hf_model(d)
    assert type(model).__name__ == cfg["architectures"][0]
    assert len(C.hf_greedy(model, [5, 6, 7], 4)) == 4


def test_same_arguments_same_bytes_and_seed_changes_them(tmp_path):
    a = C.llama_checkpoint(tmp_path / "a")
    b = C.llama_checkpoint(tmp_path / "b")
    c = C.llama_checkpoint(tmp_path / "c", seed=1)
    assert _digest(a) == _digest(b) != _digest(c)


def test_sharded_and_tied(tmp_path):
    d = C.llama_checkpoint(tmp_path / "m", max_shard_size="40KB", tie_word_embeddings=True)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert "lm_head.weight" not in index["weight_map"]


def test_llama3_rope_scaling_is_in_config(tmp_path):
    cfg = json.loads((C.llama3_checkpoint(tmp_path / "m") / "config.json").read_text())
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0


def test_tokenizer_round_trip_and_chat_template(tmp_path):
    from tokenizers import Tokenizer
    C.build_tokenizer(tmp_path)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    text = "Hello, world! café 東京 🙂"
    assert tok.decode(tok.encode(text).ids) == text
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in cfg["chat_template"] and cfg["eos_token"] == C.IM_END
    assert [C.token_id(t) for t in C.SPECIAL_TOKENS] == [0, 1, 2, 3]
