"""Bad input never produces a traceback: random argv, TOML and JSON give findings or a clean error."""

import io
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xllm_vmm.cli.check_config import run
from xllm_vmm.config import ConfigError, load
from xllm_vmm.config.catalogue import FLAGS
from xllm_vmm.config.rules import check
from xllm_vmm.config.sources import parse_shell, read_json, read_toml
from tests._hyp import examples

NAMES = sorted(FLAGS) + ["nope", "enable_vmm_kv", "noenable_prefix_cache", "config", "cmd"]
VALUES = st.one_of(st.sampled_from(["true", "false", "0", "-1", "1GiB", "2.5", "", "x", "nan",
                                    "1e400", "npu:0", "mlu:1", "MTP", "Eagle3", "Mooncake"]),
                   st.text(max_size=8))
TOKEN = st.one_of(
    st.builds(lambda n, v: f"--{n}={v}", st.sampled_from(NAMES), VALUES),
    st.builds(lambda n: f"--{n}", st.sampled_from(NAMES)),
    VALUES,
    st.text(max_size=12),
)
SETTINGS = settings(max_examples=examples(150), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(st.lists(TOKEN, max_size=8))
def test_random_argv_load_and_check(tokens):
    try:
        cfg = load(tokens)
    except ConfigError as err:
        assert err.findings and all(f.message for f in err.findings)
        return
    report = check(cfg)
    assert report.exit_code() in (0, 1)


@SETTINGS
@given(st.lists(TOKEN, max_size=6))
def test_random_argv_check_config(tokens):
    out, err = io.StringIO(), io.StringIO()
    code = run(["--format=json", "--no-env", *tokens], out=out, err=err, env={})
    assert code in (0, 1, 2)
    if out.getvalue().startswith("Usage:"):  # --help (or -h) asked for the help text
        assert code == 0
    elif out.getvalue():
        assert json.loads(out.getvalue())["exit_code"] == code


TOML_SCALAR = st.one_of(st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                        st.floats(allow_nan=True), st.text(max_size=6))


@SETTINGS
@given(st.dictionaries(st.sampled_from(NAMES + ["kv_cache", "vmm"]),
                       st.one_of(TOML_SCALAR, st.dictionaries(st.sampled_from(NAMES), TOML_SCALAR,
                                                              max_size=3)), max_size=6))
def test_random_toml_documents(doc):
    import tomli_w

    try:
        text = tomli_w.dumps(doc)
    except (TypeError, ValueError):
        return
    got, findings = read_toml("fuzz.toml", text)
    assert all(f.id.startswith("CFG-") for f in findings)


@SETTINGS
@given(st.text(max_size=80))
def test_random_toml_and_json_text(text):
    for reader in (read_toml, read_json):
        got, findings = reader("fuzz", text)
        assert all(f.id.startswith("CFG-") and f.message for f in findings)


@SETTINGS
@given(st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(),
                              st.text(max_size=5)),
                    lambda c: st.one_of(st.lists(c, max_size=3),
                                        st.dictionaries(st.sampled_from(NAMES), c, max_size=3)),
                    max_leaves=8))
def test_random_json_values(doc):
    got, findings = read_json("fuzz.json", json.dumps(doc))
    assert all(f.id.startswith("CFG-") for f in findings)


@SETTINGS
@given(st.text(max_size=120))
def test_random_shell_text(text):
    shell, findings = parse_shell(text, "fuzz.sh")
    assert shell is not None or findings
