"""Launch scripts read as bash reads them (xllm_vmm.config.shell via parse_shell / check-config):
each behaviour with its trigger and the nearest input that must not trigger it."""

from __future__ import annotations

import io
import json

import pytest

from xllm_vmm.cli.check_config import run
from xllm_vmm.config.loader import load
from xllm_vmm.config.shell import ShellSyntaxError, run_script
from xllm_vmm.config.sources import parse_shell


def flags(text: str) -> dict:
    shell, findings = parse_shell(text, "s.sh")
    assert shell is not None, findings
    cfg = load(shell.tokens, env_tokens=shell.env)
    return {n: cfg[n] for n in cfg.explicit_names()}


def check(text: str, tmp_path, *extra: str) -> tuple[int, dict]:
    p = tmp_path / "launch.sh"
    p.write_text(text)
    out = io.StringIO()
    code = run([str(p), "--format=json", *extra], out=out, err=io.StringIO(), env={})
    return code, json.loads(out.getvalue())["inputs"][0]


@pytest.mark.parametrize("assign", [
    "BS=64", "BS='64'", 'BS="64"', "export BS=64", "readonly BS=64", "local BS=64",
    "declare -i BS=64", "typeset BS=64", "N=32; BS=$((N * 2))", "BS=${UNSET_HERE:-64}",
    "B=6; BS=${B}4", "B=60; BS=$(( B + 4 ))",
])
def test_assigned_variables_are_expanded(assign):
    assert flags(f"{assign}\nxllm --block_size=$BS --port ${{PORT:-9000}}\n") == {
        "block_size": 64, "port": 9000}


def test_arithmetic_follows_bash():
    s = run_script("A=$(( 7 / -2 )) B=$(( -7 % 3 )) C=$(( 2 ** 62 * 4 )) D=$(( 010 + 0x10 ))\n")
    got = {k: v.value for k, v in s.variables.items()}
    assert got == {"A": "-3", "B": "-1", "C": "0", "D": "24"}


@pytest.mark.parametrize("value, reason", [
    ("$MODEL_DIR", "$MODEL_DIR is not set in the script"),
    ("$(cat /etc/model)", "$(cat /etc/model) runs a command"),
    ("`cat /etc/model`", "`cat /etc/model` runs a command"),
    ("$1", "$1 is set when the script runs"),
])
def test_unknown_values_are_not_checked_never_cfg_type(tmp_path, value, reason):
    code, entry = check(f"xllm --model=/m --block_size={value}\n", tmp_path)
    assert code == 0 and [f["id"] for f in entry["findings"]] == ["CFG-UNRESOLVED", "CFG-MODEL"]
    assert entry["findings"][0]["severity"] == "not_checked"
    (item,) = [n for n in entry["not_checked"] if n["flag"]]
    assert item["flag"] == "block_size" and reason in item["reason"]


def test_a_bad_value_behind_a_known_variable_is_cfg_type_naming_the_assignment(tmp_path):
    code, entry = check("BS=abc\nxllm --block_size=$BS\n", tmp_path)
    (f,) = entry["findings"]
    assert code == 1 and f["id"] == "CFG-TYPE"
    assert "block_size" in f["message"] and f"BS=abc ({tmp_path / 'launch.sh'}:1)" in f["message"]
    assert f["where"]["line"] == 2
    # nearest non-trigger: the same variable holding a number
    assert check("BS=64\nxllm --block_size=$BS\n", tmp_path)[0] == 0


def test_rules_on_an_unknown_flag_are_not_checked(tmp_path):
    # node_rank=3 with nnodes unknown: the rank rule cannot be decided on the default nnodes=1
    code, entry = check("xllm --nnodes=$N --node_rank=3\n", tmp_path)
    assert code == 0 and not [f for f in entry["findings"] if f["severity"] == "error"]
    code, entry = check("xllm --nnodes=2 --node_rank=3\n", tmp_path)
    assert code == 1


@pytest.mark.parametrize("text, want", [
    ("xllm --port=8000>log\n", {"port": 8000}),
    ("xllm --port=8000 2>&1 >log &\n", {"port": 8000}),
    ("xllm --port=8000&\n", {"port": 8000}),
    ("xllm --port=8000;echo done\n", {"port": 8000}),
    ("xllm --port=8000|tee log\n", {"port": 8000}),
    ("cd /x&&xllm --port=8000\n", {"port": 8000}),
    ("xllm --port=8000 \\ > log 2>&1 &\n", {"port": 8000}),
    ("xllm --port=8000 &>log\n", {"port": 8000}),
])
def test_operators_touching_words(text, want):
    assert flags(text) == want


def test_escaped_blank_before_a_redirection_is_an_ignored_argument():
    shell, findings = parse_shell("xllm --port=1 \\\n  --node_rank=0 \\ > log 2>&1 &\n", "s.sh")
    assert findings == [] and [t.text for t in shell.tokens] == ["--port=1", "--node_rank=0"]
    assert any("escaped blank" in n for n in shell.notes)
    # nearest non-trigger: without the backslash there is no such argument
    shell, _ = parse_shell("xllm --port=1 --node_rank=0 > log 2>&1 &\n", "s.sh")
    assert not any("escaped blank" in n for n in shell.notes)


def test_loops_are_checked_for_their_first_iteration():
    text = ("START=100\nfor (( i=0; i<$N; i++ )); do\n  P=$((START + i))\n"
            "  xllm --port=$P --node_rank=$i\ndone\n")
    shell, _ = parse_shell(text, "s.sh")
    assert [t.text for t in shell.tokens] == ["--port=100", "--node_rank=0"]
    assert any("first iteration (i=0)" in n for n in shell.notes)
    shell, _ = parse_shell("for d in 3 4; do xllm --devices=npu:$d; done\n", "s.sh")
    assert [t.text for t in shell.tokens] == ["--devices=npu:3"]
    assert any("first iteration (d=3)" in n for n in shell.notes)


def test_word_splitting_of_unquoted_expansions():
    assert flags('EXTRA="--port=1 --block_size=16"\nxllm $EXTRA\n') == {"port": 1,
                                                                        "block_size": 16}
    # quoted: one word, so the port value is the whole text
    shell, findings = parse_shell('P="1 2"\nxllm --port="$P"\n')
    assert [t.text for t in shell.tokens] == ["--port=1 2"]


def test_no_launch_command_is_unreadable_naming_what_was_seen(tmp_path):
    code, entry = check("python3 tools/export_mtp.py --input-dir /a --output-dir /b\n", tmp_path)
    (f,) = entry["findings"]
    assert code == 2 and f["id"] == "CFG-SYNTAX" and "no launch command" in f["message"]
    assert "python3 (line 1)" in f["message"]
    assert check("xllm --port=1\n", tmp_path)[0] == 0


def test_unterminated_quote_is_a_syntax_error_with_its_line():
    with pytest.raises(ShellSyntaxError) as e:
        run_script("A=1\nxllm --model='/m\n")
    assert e.value.line == 2


def test_missing_config_json_file_is_a_warning_an_error_with_strict(tmp_path):
    code, entry = check("xllm --config_json_file=/serving/host/only.json\n", tmp_path)
    assert code == 0 and [f["id"] for f in entry["findings"]] == ["CFG-JSON"]
    assert entry["findings"][0]["severity"] == "warning"
    assert check("xllm --config_json_file=/serving/host/only.json\n", tmp_path,
                 "--strict")[0] == 1
    j = tmp_path / "c.json"
    j.write_text('{"block_size": 64}')
    code, entry = check(f"xllm --config_json_file={j}\n", tmp_path)
    assert code == 0 and entry["resolved"]["block_size"]["value"] == 64


def test_json_report_has_the_same_keys_whatever_the_status(tmp_path):
    keys = None
    for text in ("xllm --port=1\n", "xllm --port=abc\n", "echo nothing\n", "xllm --model='/m\n"):
        _, entry = check(text, tmp_path)
        if keys is None:
            keys = set(entry)
        assert set(entry) == keys
    assert {"implied", "not_checked", "resolved", "derived", "launch_notes"} <= keys


def test_cfg_dup_names_both_places(tmp_path):
    code, entry = check("xllm --port=1 --port=2\n", tmp_path)
    (f,) = entry["findings"]
    p = tmp_path / "launch.sh"
    assert f["id"] == "CFG-DUP" and f"{p}:1:6" in f["message"] and f"{p}:1:15" in f["message"]
    j = tmp_path / "d.json"
    j.write_text('{"port": 1,\n "port": 2}')
    out = io.StringIO()
    run([str(j), "-f", "json"], out=out, env={})
    (f,) = json.loads(out.getvalue())["inputs"][0]["findings"]
    assert f"{j}:1:2" in f["message"] and f"{j}:2:2" in f["message"]
    # nearest non-trigger: the same value twice is accepted
    assert check("xllm --port=1 --port=1\n", tmp_path)[0] == 0


@pytest.mark.parametrize("text", [
    "X=$(( " + "(" * 3000 + "1" + ")" * 3000 + " ))\nxllm --port=$X\n",
    "X=" + "${A:-" * 2000 + "x" + "}" * 2000 + "\nxllm --port=$X\n",
    "xllm --port=" + "${A:-" * 2000 + "1" + "}" * 2000 + "\n",
], ids=["arithmetic", "assignment", "flag-value"])
def test_deeply_nested_values_are_not_checked_not_a_traceback(text):
    shell, findings = parse_shell(text, "deep.sh")
    assert findings == [] and "nested too deeply" in shell.tokens[0].unknown
    assert len(shell.tokens[0].unknown) < 200


def test_a_sourced_file_is_named_as_a_possible_origin(tmp_path):
    code, entry = check("source /opt/env.sh\nxllm --port=$P\n", tmp_path)
    (item,) = [n for n in entry["not_checked"] if n["flag"]]
    assert code == 0 and "from /opt/env.sh, which the script sources" in item["reason"]
    code, entry = check("xllm --port=$P\n", tmp_path)
    (item,) = [n for n in entry["not_checked"] if n["flag"]]
    assert "sources" not in item["reason"]


def test_an_exported_flag_variable_from_an_unknown_value_is_not_checked(tmp_path):
    code, entry = check("export XLLM_VMM_BLOCK_SIZE=$BS\nxllm --port=1\n", tmp_path)
    assert code == 0 and [f["id"] for f in entry["findings"]] == ["CFG-UNRESOLVED"]
    code, entry = check("export XLLM_VMM_BLOCK_SIZE=abc\nxllm --port=1\n", tmp_path)
    assert code == 1 and [f["id"] for f in entry["findings"]] == ["CFG-TYPE"]


@pytest.mark.parametrize("rule, severity", [
    ("CFG-UNRESOLVED", "not checked, never an error"), ("CFG-JSON", "warning"),
    ("CFG-IGNORED", "warning"), ("CFG-MODEL-CONFIG", "unreadable input: exit 2"),
    ("CFG-CONFLICT", "(input check, error)"),
])
def test_explain_names_the_severity_of_each_input_check(rule, severity):
    out = io.StringIO()
    assert run(["--explain", rule], out=out, env={}) == 0
    assert severity in out.getvalue().splitlines()[0]
