"""``xllm-vmm generate``: text (streamed) and JSON out, engine flags checked as check-config
checks them, one-line errors with exit 2, the demo banner."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tests.engine.checkpoints import hf_greedy, llama_checkpoint
from xllm_vmm.cli.app import app


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return llama_checkpoint(tmp_path_factory.mktemp("gen"))


def run(*args, input=None):
    r = CliRunner().invoke(app, ["generate", *args], input=input)
    return r.exit_code, r.stdout, r.stderr


def test_json_matches_the_reference(model):
    code, out, err = run("hello world", "--model", str(model), "-n", "5", "--ignore-eos",
                         "--format", "json", "--block_size=16", "--enable_vmm_kvcache=true",
                         "--vmm_elastic=true", "--device-memory", "96MiB")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["token_ids"] == hf_greedy(model, doc["prompt_token_ids"], 5)
    assert doc["finish_reason"] == "length" and doc["num_generated_tokens"] == 5
    assert doc["demo"] is False and doc["time_to_first_token_s"] > 0
    assert "demo model" not in err


def test_text_from_stdin_with_chat(model):
    code, out, err = run("-", "--model", str(model), "-n", "3", "--chat", "--system", "be brief",
                         "--block_size=16", "--device-memory", "96MiB", input="hi there")
    assert code == 0, err
    assert out.endswith("\n")


def test_demo_banner(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    code, out, err = run("Hello", "-m", "demo", "-n", "2", "--block_size=16", "--device-memory",
                         "128MiB")
    assert code == 0, err
    assert "demo model" in err


def test_no_model_and_no_index_falls_back_to_the_demo_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("XLLM_VMM_DEFAULT_MODEL")
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # the user's own pip settings: no index reachable
    code, out, err = run("Hello", "-n", "2", "--block_size=16", "--device-memory", "128MiB")
    assert code == 0, err
    line = [ln for ln in err.splitlines() if "cannot fetch" in ln]
    assert len(line) == 1 and "SmolLM2-135M-Instruct" in line[0] and "demo model" in line[0]
    assert not (tmp_path / "xllm-vmm" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()


@pytest.mark.parametrize("args, text", [
    (["x", "--block_sise=16"], "[CFG-UNKNOWN] unknown flag 'block_sise'"),
    (["x", "--enable_vmm_kvcache=true", "--enable_task_pipeline=true"], "[SD-04]"),
    (["x", "--top-p", "2"], "--top-p: top_p must be in (0, 1]"),
    (["x", "--seed", str(2 ** 64)], "--seed: seed must be in [-2**63, 2**64 - 1]"),
    (["x", "--device-memory", "1MiB"], "[MEMORY]"),
    (["x", "--device-memory", "lots"], "device_memory='lots' is not a positive size"),
    (["x", "--system", "s"], "--system needs --chat"),
    ([], "no prompt"),
    (["x", "y"], "unexpected argument 'y'"),
])
def test_errors_are_one_line_exit_2(model, args, text):
    code, out, err = run(*args, "--model", str(model))
    assert code == 2
    assert text in err and "Traceback" not in err and err.count("\n") == 1


def test_missing_model_is_exit_2(tmp_path):
    code, out, err = run("x", "--model", str(tmp_path / "nope"))
    assert code == 2 and "[CFG-MODEL]" in err and err.count("\n") == 1
