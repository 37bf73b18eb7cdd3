"""A model's config.json is checked for what cannot be: every random change to a real config
either reads (and then plans) or is one ModelConfigError naming the field and the file, in
bounded time and memory (a config with 1e8 layers once ran plan for minutes up to 22 GB)."""

from __future__ import annotations

import json
import signal
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests._hyp import examples
from xllm_vmm.models import ModelConfigError, load_model_spec
from xllm_vmm.models.catalogue import read_catalogue_config
from xllm_vmm.models.config_reader import MAX_FIELD
from xllm_vmm.planner import PlanInputs, make_plan

BASES = ["Qwen/Qwen3-8B", "deepseek-ai/DeepSeek-V3", "openai/gpt-oss-20b",
         "Qwen/Qwen3-Next-80B-A3B-Instruct"]
FIELDS = sorted(MAX_FIELD) + ["tie_word_embeddings", "use_sliding_window", "attention_bias",
                              "torch_dtype", "layer_types", "vision_config", "mlp_only_layers",
                              "quantization_config"]
VALUES = st.one_of(
    st.integers(min_value=-10, max_value=10**12), st.sampled_from([0, 1, 10**8, 10**11, 2**63]),
    st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
    st.sampled_from(["false", "true", "64", "abc", "", "1e8"]),
    st.lists(st.integers(min_value=-2, max_value=4), max_size=3), st.just({"hidden_size": "x"}),
)


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


@settings(max_examples=examples(60), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(BASES), st.dictionaries(st.sampled_from(FIELDS), VALUES, min_size=1,
                                               max_size=3))
def test_random_config_json_reads_or_names_the_field(tmp_path_factory, base, changes):
    cfg = dict(read_catalogue_config(base))
    cfg.update(changes)
    d = tmp_path_factory.mktemp("m")
    (d / "config.json").write_text(json.dumps(cfg))
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(30)  # bounded time: far above the milliseconds one example takes
    tracemalloc.start()
    try:
        try:
            spec = load_model_spec(str(d))
        except ModelConfigError as err:
            text = str(err)
            assert "\n" not in text and str(d / "config.json") in (err.source or "") + text
            assert any(k in text for k in cfg) or "config.json" in text
            return
        plan = make_plan(spec, PlanInputs(workers=1, context_len=4096), suggest=False)
        assert plan.verdict in ("fits", "does_not_fit")
        _, peak = tracemalloc.get_traced_memory()
        assert peak < 256 << 20  # bounded memory
    except _Timeout:
        pytest.fail(f"config.json {changes} took more than 30 s")
    finally:
        tracemalloc.stop()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("field, value, message", [
    ("tie_word_embeddings", "false", "'tie_word_embeddings' must be true or false, got 'false' "
                                     "(a string: write it without quotes)"),
    ("num_key_value_heads", 64, "'num_key_value_heads' is 64, which does not divide "
                                "num_attention_heads 32"),
    ("num_key_value_heads", 5, "'num_key_value_heads' is 5, which does not divide"),
    ("hidden_size", 0, "'hidden_size' must be >= 1, got 0"),
    ("vocab_size", -1, "'vocab_size' must be >= 1, got -1"),
    ("num_hidden_layers", 1e8, "'num_hidden_layers' is 100,000,000, more than any model can "
                               "have"),
    ("num_hidden_layers", 1e11, "'num_hidden_layers' is 100,000,000,000"),
    ("num_hidden_layers", "36", "must be an integer, got '36' (a string"),
])
def test_impossible_fields_are_one_line_errors(tmp_path, field, value, message):
    cfg = dict(read_catalogue_config("Qwen/Qwen3-8B"))
    cfg[field] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError) as e:
        load_model_spec(str(tmp_path))
    assert message in e.value.message and e.value.source == str(tmp_path / "config.json")


@pytest.mark.parametrize("field, value", [
    ("tie_word_embeddings", False), ("tie_word_embeddings", True), ("num_key_value_heads", 8),
    ("num_key_value_heads", 32), ("num_hidden_layers", 36.0), ("num_hidden_layers", 10_000),
])
def test_nearest_valid_fields_read(tmp_path, field, value):
    cfg = dict(read_catalogue_config("Qwen/Qwen3-8B"))
    cfg[field] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    load_model_spec(str(tmp_path))


def test_check_config_and_plan_exit_2_naming_field_and_file(tmp_path):
    import io

    from typer.testing import CliRunner

    from xllm_vmm.cli.app import app
    from xllm_vmm.cli.check_config import run

    cfg = dict(read_catalogue_config("Qwen/Qwen3-8B"), tie_word_embeddings="false")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = io.StringIO()
    assert run([f"--model={tmp_path}", "--format=json"], out=out, env={}) == 2
    (f,) = json.loads(out.getvalue())["inputs"][0]["findings"]
    assert f["id"] == "CFG-MODEL-CONFIG" and "tie_word_embeddings" in f["message"]
    assert str(tmp_path / "config.json") in f["message"]
    r = CliRunner().invoke(app, ["plan", f"--model={tmp_path}"], env={})
    assert r.exit_code == 2 and "tie_word_embeddings" in r.stderr and "Traceback" not in r.output
