"""GGUF checkpoints: a GGUF written by the ``gguf`` package's writer from a tiny checkpoint
loads to the same tensors (exactly for F32/F16/BF16, within the format's error for quantized
types), its tokenizer encodes and decodes as the original's, it generates the same tokens as
the safetensors original, ``plan``/``check-config`` size it from the header, and bad input is
one line naming the file (and the tensor or type) with nothing left mapped."""

from __future__ import annotations

import json

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from tests.engine.checkpoints import (  # noqa: E402
    CORPUS, llama3_checkpoint, llama_checkpoint, qwen2_checkpoint, qwen3_checkpoint)
from tests.models.gguf_writer import gguf_name, write_gguf  # noqa: E402
from xllm_vmm.models import load_model_spec  # noqa: E402
from xllm_vmm.models.gguf import (  # noqa: E402
    GgufError, convert, converted_dir, iter_tensors, open_gguf, permute, read_config, unpermute)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return llama_checkpoint(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def llama_gguf(llama, tmp_path_factory):
    return write_gguf(llama, tmp_path_factory.mktemp("g") / "tiny-llama.gguf")


def _original(d):
    from safetensors.numpy import load_file

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return {k: v.astype(np.float32) for k, v in out.items()}


def _loaded(path, dtype="float32"):
    with open_gguf(path) as r:
        from xllm_vmm.models.gguf import config_from_reader

        cfg = config_from_reader(r, path)
        return dict(iter_tensors(r, path, cfg, dtype))


def _mapped(path) -> bool:
    with open("/proc/self/maps") as fh:
        return any(str(path) in line for line in fh)


def test_permutation_is_undone_exactly():
    a = np.arange(8 * 2 * 4 * 3, dtype=np.float32).reshape(8 * 2 * 4, 3)
    for heads in (1, 2, 4, 8):
        assert np.array_equal(unpermute(permute(a, heads), heads), a)
    assert not np.array_equal(permute(a, 4), a)


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16"])
def test_float_types_load_to_the_same_tensors_exactly(llama, tmp_path, qtype):
    path = write_gguf(llama, tmp_path / f"m-{qtype}.gguf", qtype)
    ref = _original(llama)
    got = _loaded(path)
    assert set(got) == set(ref)
    for name, a in ref.items():
        want = a
        if a.ndim == 2 and qtype == "F16":
            want = a.astype(np.float16).astype(np.float32)
        elif a.ndim == 2 and qtype == "BF16":
            import torch

            want = torch.from_numpy(a).to(torch.bfloat16).float().numpy()
        assert np.array_equal(got[name], want), name
    assert not _mapped(path)


@pytest.mark.parametrize("qtype, rel", [("Q8_0", 1 / 120), ("Q4_0", 1 / 6), ("Q4_1", 1 / 12),
                                        ("Q5_0", 1 / 14), ("Q5_1", 1 / 28)])
def test_quantized_types_load_within_the_formats_error(llama, tmp_path, qtype, rel):
    path = write_gguf(llama, tmp_path / f"m-{qtype}.gguf", qtype)
    ref = _original(llama)
    got = _loaded(path)
    qt = getattr(gguf.GGMLQuantizationType, qtype)
    for name, a in ref.items():
        if a.ndim == 1:
            assert np.array_equal(got[name], a), name
            continue
        heads = {"q_proj": 4, "k_proj": 2}
        kind = next((k for k in heads if k in name), None)
        # the format's own round trip (quantize, dequantize) is what must come back exactly
        p = permute(a, heads[kind]) if kind else a
        rt = gguf.quants.dequantize(gguf.quants.quantize(p, qt), qt).reshape(a.shape)
        rt = unpermute(rt, heads[kind]) if kind else rt
        assert np.array_equal(got[name], rt), name
        blocks = np.abs(a).reshape(a.shape[0], -1, 32).max(axis=2, keepdims=True)
        err = np.abs(got[name] - a).reshape(a.shape[0], -1, 32)
        assert (err <= blocks * rel + 1e-6).all(), name


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_k_quants_are_dequantized_by_the_gguf_package(tmp_path, qtype):
    """K-quant blocks (here random bytes with sane scales) read as gguf.quants.dequantize
    reads them: the loader's plumbing (shape, order) for the types small models ship."""
    qt = getattr(gguf.GGMLQuantizationType, qtype)
    block, nbytes = gguf.GGML_QUANT_SIZES[qt]
    rows, cols = 4, 512
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(rows, cols // block * nbytes), dtype=np.uint8)
    ref = gguf.quants.dequantize(raw, qt)
    w = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    w.add_tensor("blk.0.ffn_up.weight", raw, raw_shape=raw.shape, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    from xllm_vmm.models.gguf import _dequantize

    with open_gguf(tmp_path / "k.gguf") as r:
        (t,) = r.tensors
        got = _dequantize(t, (rows, cols), "k.gguf")
    np.testing.assert_array_equal(got, ref.reshape(rows, cols))


def test_llama3_rope_scaling_comes_back_from_rope_freqs(tmp_path):
    src = llama3_checkpoint(tmp_path / "src")
    want = json.loads((src / "config.json").read_text())["rope_parameters"]
    got = read_config(write_gguf(src, tmp_path / "m.gguf"))["rope_scaling"]
    assert got == {k: want[k] for k in ("rope_type", "factor", "low_freq_factor",
                                        "high_freq_factor", "original_max_position_embeddings")}


def test_config_and_spec_come_from_the_header(llama, llama_gguf):
    cfg = read_config(llama_gguf)
    orig = json.loads((llama / "config.json").read_text())
    for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "vocab_size", "max_position_embeddings", "head_dim",
              "tie_word_embeddings"):
        assert cfg[k] == orig[k], k
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["torch_dtype"] == "float32"
    spec = load_model_spec(str(llama_gguf), read_weights=False)
    ref = load_model_spec(str(llama), read_weights=False)
    assert (spec.num_layers, spec.hidden_size) == (ref.num_layers, ref.hidden_size)
    assert load_model_spec(str(llama_gguf.parent)).num_layers == ref.num_layers


def test_tokenizer_encodes_and_decodes_like_the_original(llama, llama_gguf, tmp_path):
    from xllm_vmm.engine.tokenizer import Tokenizer

    d = convert(llama_gguf, tmp_path / "conv")
    a, b = Tokenizer.from_dir(llama), Tokenizer.from_dir(d)
    for text in (CORPUS, "Hello, world! 漢字 🙂 <|im_start|>user\nhi<|im_end|>", "  two  spaces\n\n"):
        assert b.encode(text) == a.encode(text)
        assert b.decode(b.encode(text)) == a.decode(a.encode(text))
        assert b.decode(b.encode(text), skip_special_tokens=False) == \
            a.decode(a.encode(text), skip_special_tokens=False)
    msgs = [{"role": "user", "content": "hi"}]
    assert b.apply_chat_template(msgs) == a.apply_chat_template(msgs)
    assert set(a.eos_token_ids) <= set(b.eos_token_ids)


@pytest.mark.parametrize("family", ["llama", "llama-tied", "llama3", "qwen2", "qwen3"])
def test_generates_the_same_tokens_as_the_safetensors_original(tmp_path, family):
    from xllm_vmm import LLM, SamplingParams

    build = {"llama": llama_checkpoint, "llama-tied": llama_checkpoint, "llama3": llama3_checkpoint,
             "qwen2": qwen2_checkpoint, "qwen3": qwen3_checkpoint}[family]
    src = build(tmp_path / "src", **({"tie_word_embeddings": True} if family == "llama-tied" else {}))
    path = write_gguf(src, tmp_path / "m.gguf")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 17, 33, 101, 7], list(range(4, 40))]
    outs = []
    for model in (str(src), str(path)):
        with LLM(model, block_size=16, device_memory="96MiB", max_tokens_per_batch=256,
                 enable_vmm_kvcache=True) as llm:
            outs.append([o.outputs[0].token_ids for o in
                         llm.generate([{"prompt_token_ids": p} for p in prompts], params)])
    assert outs[0] == outs[1]


def test_conversion_is_cached_by_digest_and_dtype(llama_gguf, tmp_path):
    a = converted_dir(llama_gguf, cache_dir=tmp_path)
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert converted_dir(llama_gguf, cache_dir=tmp_path) == a
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime
    b = converted_dir(llama_gguf, dtype="bfloat16", cache_dir=tmp_path)
    assert b != a and json.loads((b / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert (b / "model.safetensors").stat().st_size < (a / "model.safetensors").stat().st_size
    assert not _mapped(llama_gguf)


# -- bad input -----------------------------------------------------------------------------
def _one_line(err: Exception, *words: str) -> None:
    text = str(err)
    assert "\n" not in text
    for w in words:
        assert w in text, (w, text)


def test_wrong_magic(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(GgufError) as e:
        read_config(p)
    _one_line(e.value, str(p), "not a GGUF file")


def test_truncated_header_and_truncated_tensors(llama_gguf, tmp_path):
    data = llama_gguf.read_bytes()
    head = tmp_path / "head.gguf"
    head.write_bytes(data[:300])
    with pytest.raises(GgufError) as e:
        read_config(head)
    _one_line(e.value, str(head), "truncated")
    assert not _mapped(head)
    tail = tmp_path / "tail.gguf"
    tail.write_bytes(data[: len(data) - 4096])
    with pytest.raises(GgufError) as e:
        convert(tail, tmp_path / "out")
    _one_line(e.value, str(tail), "truncated")
    assert not _mapped(tail)


def test_unknown_tensor_type_names_the_tensor_and_the_supported_types(tmp_path):
    p = tmp_path / "iq.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    qt = gguf.GGMLQuantizationType.IQ4_NL
    block, nbytes = gguf.GGML_QUANT_SIZES[qt]
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((2, 64 // block * nbytes), np.uint8),
                 raw_shape=(2, 64 // block * nbytes), raw_dtype=qt)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    from xllm_vmm.models.gguf import _plan_tensors

    with pytest.raises(GgufError) as e, open_gguf(p) as r:
        _plan_tensors(r, str(p), {"model_type": "llama"})
    _one_line(e.value, str(p), "blk.0.ffn_up.weight", "IQ4_NL", "Q4_K")
    assert not _mapped(p)


def test_unsupported_architecture(llama, tmp_path):
    p = write_gguf(llama, tmp_path / "bert.gguf", arch="bert")
    with pytest.raises(GgufError) as e:
        read_config(p)
    _one_line(e.value, str(p), "'bert'", "llama", "qwen3")
    assert not _mapped(p)


def test_cli_says_one_line_and_exits_2(tmp_path):
    from typer.testing import CliRunner

    from xllm_vmm.cli.app import app

    p = tmp_path / "bad.gguf"
    p.write_bytes(b"GGUF" + b"\xff" * 40)
    r = CliRunner().invoke(app, ["generate", "hi", "--model", str(p), "--device-memory", "96MiB"])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and str(p) in lines[0] and "Traceback" not in r.output


def test_tensor_names_round_trip():
    from xllm_vmm.models.gguf import hf_name

    for n in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
              "model.layers.3.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.bias",
              "model.layers.1.self_attn.q_norm.weight", "model.layers.2.mlp.down_proj.weight"):
        assert hf_name(gguf_name(n)) == n


def test_plan_and_check_config_size_from_the_header_alone(llama_gguf, tmp_path, monkeypatch):
    """``plan`` and ``check-config`` read the metadata: no tensor is dequantized (the reader
    maps the file; its tensor pages are never touched)."""
    from typer.testing import CliRunner

    import xllm_vmm.models.gguf as g
    from xllm_vmm.cli.app import app
    from xllm_vmm.cli.check_config import run as check_config

    def no_tensor_reads(*a, **k):
        raise AssertionError("a tensor was read")

    monkeypatch.setattr(g, "_dequantize", no_tensor_reads)
    r = CliRunner().invoke(app, ["plan", f"--model={llama_gguf}", "--device-memory=1GiB"])
    assert r.exit_code == 0, r.output
    assert "2 layers" in r.stdout and "float32" in r.stdout
    assert check_config([f"--model={llama_gguf}"]) == 0
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 40)
    assert check_config([f"--model={bad}"]) == 2
    assert not _mapped(llama_gguf) and not _mapped(bad)
