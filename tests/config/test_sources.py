"""Sources, precedence and provenance."""

import json

import pytest

from xllm_vmm.config import ConfigError, load
from xllm_vmm.config.sources import parse_args, parse_shell, read_toml


def ids(err: ConfigError):
    return [f.id for f in err.findings]


def test_gflags_forms():
    cfg = load(["--enable-vmm-kvcache", "--noenable_prefix_cache", "--port", "9000",
                "-block_size=64", "--max_cache_size=536870912", "--host_blocks_factor", "2.5"])
    assert cfg["enable_vmm_kvcache"] is True
    assert cfg["enable_prefix_cache"] is False
    assert cfg["port"] == 9000 and cfg["block_size"] == 64
    assert cfg["max_cache_size"] == 512 * 1024 * 1024
    assert cfg["host_blocks_factor"] == 2.5
    assert cfg.provenance("port").text == "--port 9000"
    assert cfg.explicit("port") and not cfg.explicit("tp_size")


@pytest.mark.parametrize("text,value", [("1GiB", 1 << 30), ("1G", 1 << 30), ("1GB", 10**9),
                                        ("1.5GiB", 3 << 29), ("4096", 4096), ("0", 0)])
def test_sizes_reported_as_integers(text, value):
    # sizes are this tool's convenience in TOML and XLLM_VMM_* variables ...
    assert load(env={"XLLM_VMM_VMM_MEMORY_RESERVE_BYTES": text})[
        "vmm_memory_reserve_bytes"] == value
    # ... the engine's command line takes bytes only (gflags int64)
    if not text.isdigit():
        with pytest.raises(ConfigError) as e:
            load([f"--vmm_memory_reserve_bytes={text}"])
        assert f"no size suffix); write {value}" in e.value.findings[0].message
    else:
        assert load([f"--vmm_memory_reserve_bytes={text}"])["vmm_memory_reserve_bytes"] == value


def test_size_rejected_for_non_byte_flag():
    with pytest.raises(ConfigError) as e:
        load(["--block_size=1KiB"])
    assert ids(e.value) == ["CFG-TYPE"]
    assert "expected an integer (int32, 1..2147483647)" in e.value.findings[0].message


def test_unknown_flag_suggests():
    with pytest.raises(ConfigError) as e:
        load(["--enable_vmm_kv_cache=true"])
    f = e.value.findings[0]
    assert f.id == "CFG-UNKNOWN" and "enable_vmm_kvcache" in f.hint


def test_bool_value_errors_and_negation_with_value():
    with pytest.raises(ConfigError) as e:
        load(["--enable_vmm_kvcache=maybe", "--noport", "--noenable_prefix_cache=true"])
    assert ids(e.value) == ["CFG-TYPE", "CFG-UNKNOWN", "CFG-TYPE"]
    assert "expected a bool (true or false)" in e.value.findings[0].message


def test_duplicate_with_different_values_is_an_error_same_value_is_not():
    assert load(["--port=1", "--port=1"])["port"] == 1
    with pytest.raises(ConfigError) as e:
        load(["--port=1", "--port", "2"])
    assert ids(e.value) == ["CFG-DUP"]
    assert "port is given twice with different values: 1" in e.value.findings[0].message


def test_out_of_range_and_missing_value():
    with pytest.raises(ConfigError) as e:
        load(["--xxh3_128bits_seed=-1", "--port=70000", "--model"])
    assert ids(e.value) == ["CFG-TYPE", "CFG-TYPE", "CFG-TYPE"]
    assert "--model needs a value" in e.value.findings[2].message


def test_precedence_json_over_cli_over_env_over_toml(tmp_path):
    a = tmp_path / "a.toml"
    a.write_text("port = 1\nblock_size = 16\nmax_seqs_per_batch = 7\nrandom_seed = 3\n")
    b = tmp_path / "b.toml"
    b.write_text("[scheduler]\nmax_seqs_per_batch = 8\n")
    j = tmp_path / "engine.json"
    j.write_text(json.dumps({"port": 4}))
    env = {"XLLM_VMM_PORT": "2", "XLLM_VMM_BLOCK_SIZE": "32", "OTHER": "x"}
    cfg = load(["--port=3", f"--config_json_file={j}"], [a, b], env=env)
    assert cfg["port"] == 4 and cfg.provenance("port").kind == "json"
    assert cfg.provenance("port").location() == f"{j}:1:2"
    assert cfg["block_size"] == 32 and cfg.provenance("block_size").env == "XLLM_VMM_BLOCK_SIZE"
    assert cfg["max_seqs_per_batch"] == 8
    assert cfg.provenance("max_seqs_per_batch").location() == f"{b}:2:1"
    assert cfg["random_seed"] == 3
    cfg = load(["--port=3"], [a], env=env)
    assert cfg["port"] == 3


def test_toml_errors_point_at_line_and_column(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("enable_vmm_kvcache = true\n[kv_cache]\nblock_size = \"big\"\nblok_size = 3\n")
    with pytest.raises(ConfigError) as e:
        load([], [p])
    type_err, unknown = e.value.findings
    assert type_err.id == "CFG-TYPE"
    assert type_err.message.startswith(f"{p}:3:1: 'big' is not valid for block_size")
    assert 'block_size = "big"' in type_err.message
    assert unknown.id == "CFG-UNKNOWN" and unknown.where.line == 4
    assert "block_size" in unknown.hint


def test_toml_syntax_error_is_unreadable(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("port = 1\nmodel = \n")
    with pytest.raises(ConfigError) as e:
        load([], [p])
    f = e.value.findings[0]
    assert f.id == "CFG-SYNTAX" and e.value.unreadable
    assert (f.where.line, f.where.col) == (2, 9)


def test_toml_wrong_type_says_expected():
    got, findings = read_toml("x.toml", "enable_vmm_kvcache = \"yes\"\nport = 1.5\n")
    assert got == []
    assert [f.id for f in findings] == ["CFG-TYPE", "CFG-TYPE"]
    assert "expected a bool (true or false)" in findings[0].message


def test_json_config_file_errors(tmp_path):
    p = tmp_path / "e.json"
    p.write_text('{"port": 1,\n "nope": 2}')
    with pytest.raises(ConfigError) as e:
        load(json_file=p)
    assert ids(e.value) == ["CFG-UNKNOWN"] and e.value.findings[0].where.line == 2
    # a file that does not exist here is a warning (it often lives on the serving host only);
    # one that exists but cannot be read is unreadable input
    cfg = load(json_file=tmp_path / "missing.json")
    assert [f.id for f in cfg.warnings] == ["CFG-JSON"] and cfg.warnings[0].severity == "warning"
    with pytest.raises(ConfigError) as e:
        load(json_file=tmp_path)
    assert ids(e.value) == ["CFG-READ"] and e.value.unreadable


def test_env_close_misspelling_warns():
    cfg = load(env={"XLLM_VMM_ENABLE_VMM_KVCACH": "1", "XLLM_VMM_SOMETHING_ELSE": "x"})
    assert [f.id for f in cfg.warnings] == ["CFG-UNKNOWN"]
    assert "XLLM_VMM_ENABLE_VMM_KVCACHE" in cfg.warnings[0].hint


SCRIPT = """#!/usr/bin/env bash
# launch the server
set -e
export XLLM_VMM_VMM_ELASTIC=true
ASCEND_RT_VISIBLE_DEVICES=0,1 nohup /opt/xllm/bin/xllm \\
    --model=/models/qwen \\
    --enable_vmm_kvcache=true \\
    --port 9000 \\
    --devices="npu:0,npu:1" > run.log 2>&1 &
"""


def test_cmd_file_parsing_positions_and_env(tmp_path):
    p = tmp_path / "launch.sh"
    p.write_text(SCRIPT)
    shell, findings = parse_shell(SCRIPT, str(p))
    assert findings == []
    assert shell.binary == "/opt/xllm/bin/xllm"
    assert [t.text for t in shell.tokens] == [
        "--model=/models/qwen", "--enable_vmm_kvcache=true", "--port", "9000",
        "--devices=npu:0,npu:1"]
    assert [(t.line, t.col) for t in shell.tokens][:2] == [(6, 5), (7, 5)]
    cfg = load(shell.tokens, env_tokens=shell.env)
    assert cfg["vmm_elastic"] is True
    assert cfg.provenance("vmm_elastic").location() == f"{p}:4:8"
    assert cfg.provenance("port").location() == f"{p}:8:5"


def test_shell_without_flags_and_bad_quotes():
    assert parse_shell("echo hello")[1][0].id == "CFG-SYNTAX"
    assert parse_shell("xllm --model='/m")[1][0].id == "CFG-SYNTAX"


def test_positional_argument_is_reported():
    _, findings = parse_args(["--port=1", "stray"])
    assert [f.id for f in findings] == ["CFG-ARG"]


def test_cmd_file_picks_the_engine_command_not_the_last_with_dashes(tmp_path):
    text = ("/opt/xllm/bin/xllm --model=/m --enable_vmm_kvcache=true "
            "--enable_task_pipeline=true &\nsleep 30\n"
            "curl --retry 5 --fail http://localhost:8010/health\n")
    shell, findings = parse_shell(text, "l6.sh")
    assert findings == []
    assert shell.binary == "/opt/xllm/bin/xllm" and shell.line == 1
    assert [t.text for t in shell.tokens] == [
        "--model=/m", "--enable_vmm_kvcache=true", "--enable_task_pipeline=true"]
    assert shell.describe("l6.sh") == "l6.sh:1 (/opt/xllm/bin/xllm: the engine)"


def test_without_an_engine_program_the_command_with_most_known_flags_wins():
    text = ("python serve.py --model=/m --tp_size=2 --port 9000\n"
            "curl --retry 5 --fail --max-time 3 http://localhost:9000/health\n")
    shell, findings = parse_shell(text)
    assert findings == [] and shell.binary == "python" and shell.line == 1
    assert "most known flags (3)" in shell.why


def test_a_comment_line_ends_the_continuation_as_in_bash(tmp_path):
    text = ("xllm --model=Qwen/Qwen3-8B \\\n  --enable_vmm_kvcache=true \\\n# a comment\n"
            "  --vmm_elastic=true --max_memory_utilization=0.5\n")
    shell, findings = parse_shell(text, "l7.sh")
    assert [t.text for t in shell.tokens] == ["--model=Qwen/Qwen3-8B",
                                              "--enable_vmm_kvcache=true"]
    assert [f.id for f in findings] == ["CFG-SHELL"]
    assert findings[0].severity == "error" and findings[0].where.location() == "l7.sh:4:3"
    assert "broken by the comment line at l7.sh:3" in findings[0].message


@pytest.mark.parametrize("between,cause", [
    ("\n", "the blank line at line 2"),
    ("", "the missing backslash at the end of line 1"),
])
def test_stray_flag_lines_name_the_cause(between, cause):
    text = "xllm --model=/m" + (" \\\n" if between else "\n") + between + "  --port=1\n"
    shell, findings = parse_shell(text)
    assert [t.text for t in shell.tokens] == ["--model=/m"]
    assert [f.id for f in findings] == ["CFG-SHELL"] and cause in findings[0].message


def test_shell_words_follow_bash():
    # '#' inside a word is not a comment; a backslash at the end of a comment continues
    # nothing; a quoted newline stays in the word; "a"\<newline>b joins without a space.
    shell, findings = parse_shell("xllm --model=/m#x --port=1 # note \\\n"
                                  "xllm --model='/a\nb' --host=h\\\nost\n")
    assert findings == []
    assert [t.text for t in shell.tokens] == ["--model=/a\nb", "--host=host"]
    first, _ = parse_shell("xllm --model=/m#x --port=1 # note --tp_size=2\n")
    assert [t.text for t in first.tokens] == ["--model=/m#x", "--port=1"]


@pytest.mark.parametrize("argv,message,hint", [
    (["--kv_cache_dtype=bogus"], "'bogus' is not a value of kv_cache_dtype",
     "set kv_cache_dtype to one of auto, bfloat16, bf16,"),
    (["--speculative_algorithm=bogus"], "'bogus' is not a value of speculative_algorithm",
     "set speculative_algorithm to one of MTP, Eagle3, Suffix, DFlash"),
    (["--speculative_algorithm=mpt"], "(did you mean MTP?)", "one of MTP,"),
    (["--instance_role", "PREFIL"], "(did you mean PREFILL?)", "DEFAULT, PREFILL, DECODE, MIX"),
])
def test_fixed_value_flags_reject_other_values(argv, message, hint):
    _, findings = parse_args(argv)
    assert [f.id for f in findings] == ["CFG-TYPE"]
    assert message in findings[0].message and hint in findings[0].hint


def test_fixed_value_flags_take_the_engines_spelling_and_empty_backend(tmp_path):
    assigned, findings = parse_args(["--speculative_algorithm=Eagle3", "--backend=",
                                     "--kv_cache_dtype=bf16", "--kv_cache_transfer_type=Mooncake"])
    assert findings == [] and [a.value for a in assigned] == ["Eagle3", "", "bf16", "Mooncake"]
    p = tmp_path / "c.toml"
    p.write_text('kv_cache_dtype = "bogus"\n')
    with pytest.raises(ConfigError) as e:
        load(config_files=[p])
    assert e.value.findings[0].id == "CFG-TYPE"
    assert "'bogus' is not a value of kv_cache_dtype" in e.value.findings[0].message


@pytest.mark.parametrize("argv, message", [
    (["--speculative_algorithm=mtp"], "'mtp' is not a value of speculative_algorithm: the engine "
                                      "compares the value exactly (did you mean MTP?)"),
    (["--kv_cache_transfer_type=mooncake"], "'mooncake' is not a value of kv_cache_transfer_type: "
                                            "the engine compares the value exactly (did you mean "
                                            "Mooncake?)"),
    (["--kv_cache_dtype=BF16"], "'BF16' is not a value of kv_cache_dtype: the engine compares "
                                "the value exactly (did you mean bf16?)"),
])
def test_a_case_only_mismatch_is_an_error_with_the_engines_spelling(argv, message):
    _, findings = parse_args(argv)
    assert [(f.id, f.severity) for f in findings] == [("CFG-TYPE", "error")]
    assert findings[0].message.startswith(message)


def test_toml_dates_are_shown_as_written_not_as_python_reprs(tmp_path):
    p = tmp_path / "d.toml"
    p.write_text("port = 1979-05-27T07:32:00Z\nmodel = 2024-01-01\n")
    with pytest.raises(ConfigError) as e:
        load(config_files=[p])
    msgs = [f.message for f in e.value.findings]
    assert "datetime" not in " ".join(msgs)
    assert msgs[0] == (f"{p}:1:1: the date-time 1979-05-27T07:32:00Z is not valid for port: "
                       "expected an integer (int32, 0..65535): port = 1979-05-27T07:32:00Z")
    assert msgs[1] == (f"{p}:2:1: the date 2024-01-01 is not valid for model: expected a "
                       "string: model = 2024-01-01")


@pytest.mark.parametrize("wrapper", [
    "numactl -N 0", "taskset -c 0-7", "sudo -u svc", "timeout 3600",
    "docker run --rm --name xllm-1 -v /models:/models img",
    "env XLLM_VMM_PORT=9 numactl --cpunodebind 0 --membind 0"])
def test_wrappers_with_separate_option_values_find_the_engine(wrapper):
    text = f"{wrapper} /opt/xllm/bin/xllm --model=/m --enable_vmm_kvcache --enable_task_pipeline"
    shell, findings = parse_shell(text)
    assert findings == []
    assert shell.binary == "/opt/xllm/bin/xllm" and shell.why == "the engine"
    assert [t.text for t in shell.tokens] == [
        "--model=/m", "--enable_vmm_kvcache", "--enable_task_pipeline"]


def test_wrapper_without_an_engine_word_is_checked_as_before():
    shell, findings = parse_shell("numactl -N 0 python serve.py --model=/m --port 9000")
    assert findings == [] and shell.binary == "0"
    assert [t.text for t in shell.tokens] == ["python", "serve.py", "--model=/m", "--port", "9000"]
