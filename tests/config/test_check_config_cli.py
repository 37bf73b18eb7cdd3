"""``xllm-vmm check-config`` end to end: exit codes, formats, inputs, examples."""

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from xllm_vmm.cli.check_config import run

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.toml"))


def check(*argv, env=None):
    out, err = io.StringIO(), io.StringIO()
    code = run(list(argv), out=out, err=err, env=env or {})
    return code, out.getvalue(), err.getvalue()


def test_five_examples_shipped():
    assert [p.name for p in CONFIGS] == [
        "elastic-1gib-reserve.toml", "kv-vmm-prefix-host-offload.toml", "mtp-kv-vmm.toml",
        "pd-mooncake-fixed-pool.toml", "weight-only-vmm.toml"]


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_examples_check_clean_strict(path):
    code, out, _ = check(str(path), "--strict", "--format", "json")
    doc = json.loads(out)
    assert code == 0, doc["inputs"][0]["findings"]
    assert doc["summary"] == {"inputs": 1, "errors": 0, "warnings": 0}
    assert path.read_text().startswith("#:schema ./xllm-vmm.schema.json\n")


def test_gflags_on_check_config_itself():
    code, out, _ = check("--enable_vmm_kvcache=true", "--enable_task_pipeline=true")
    assert code == 1 and "SD-04" in out
    assert check("--enable_vmm_kvcache=true", "--enable_task_pipeline=false")[0] == 0


def test_exit_codes_strict_and_unreadable(tmp_path):
    warn = ("--enable_vmm_kvcache", "--vmm_elastic", "--max_memory_utilization", "0.7")
    assert check(*warn)[0] == 0
    assert check(*warn, "--strict")[0] == 1
    assert check(str(tmp_path / "missing.toml"))[0] == 2
    assert check("--format=yaml")[0] == 2
    assert check("--bogus_flag=1")[0] == 1


def test_several_inputs_one_exit_code(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("enable_vmm_kvcache = true\nkv_cache_dtype = \"int8\"\n")
    code, out, _ = check(str(CONFIGS[0]), str(bad), "--cmd", "xllm --port=1", "--format", "json")
    doc = json.loads(out)
    assert code == 1 and doc["exit_code"] == 1
    assert [i["input"] for i in doc["inputs"]] == [str(CONFIGS[0]), str(bad), "--cmd #1"]
    assert [i["status"] for i in doc["inputs"]] == ["ok", "errors", "ok"]
    f = doc["inputs"][1]["findings"][0]
    assert f["id"] == "QK-01" and f["severity"] == "error"
    assert f["flags"] == {"kv_cache_dtype": "int8", "enable_vmm_kvcache": True}
    assert f["sources"]["kv_cache_dtype"] == {"kind": "toml", "file": str(bad), "line": 2,
                                              "col": 1, "text": 'kv_cache_dtype = "int8"'}
    assert doc["schema_version"] == 1
    resolved = doc["inputs"][1]["resolved"]
    assert resolved["enable_vmm_kvcache"]["source"]["kind"] == "toml"
    assert doc["inputs"][1]["derived"]["prefix_cache"]["rule"] == "PC-01"


def test_cmd_file_github_annotations(tmp_path):
    script = tmp_path / "launch.sh"
    script.write_text("#!/bin/sh\n# serve\nxllm --model=Qwen/Qwen3-8B \\\n  --enable_vmm_kvcache=true \\\n"
                      "  --kv_cache_dtype=fp8\n")
    code, out, _ = check("--cmd-file", str(script), "--format", "github")
    assert code == 1
    first = out.splitlines()[0]
    assert first.startswith(f"::error file={script},line=5,col=3,title=QK-01::QK-01: ")


def test_explain_prints_rule_and_sentence():
    code, out, _ = check("--explain", "el-02")
    assert code == 0
    assert out.startswith("EL-02 (warning)")
    assert "An existing setting such as max_memory_utilization=0.75 has no effect" in out
    code, _, err = check("--explain", "SD-9")
    assert code == 2 and "no rule" in err


def test_write_resolved_round_trips(tmp_path):
    out_file = tmp_path / "resolved.toml"
    code, _, _ = check("--enable_vmm_weights", "--vmm_elastic", "--backend=llm",
                       "--write-resolved", str(out_file))
    assert code == 0
    text = out_file.read_text()
    assert "enable_manual_loader = true" in text  # derived by VMM-04
    assert check(str(out_file), "--strict")[0] == 0


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_write_resolved_to_an_unwritable_path_prints_no_report_claiming_exit_0(tmp_path, fmt):
    bad = tmp_path / "missing-dir" / "x.toml"
    code, out, err = check("--enable_vmm_kvcache", "--format", fmt, "--write-resolved", str(bad))
    assert code == 2 and out == ""
    assert err == (f"error: cannot write --write-resolved {bad}: No such file or directory "
                   "(no report printed; give a path in a writable directory)\n")


def test_environment_is_a_source():
    code, out, _ = check("--format", "json", env={"XLLM_VMM_ENABLE_VMM_KVCACHE": "true",
                                                  "XLLM_VMM_ENABLE_TASK_PIPELINE": "1"})
    assert code == 1
    f = json.loads(out)["inputs"][0]["findings"][0]
    assert f["sources"]["enable_task_pipeline"]["env"] == "XLLM_VMM_ENABLE_TASK_PIPELINE"
    assert check("--no-env", env={"XLLM_VMM_ENABLE_TASK_PIPELINE": "1",
                                  "XLLM_VMM_ENABLE_VMM_KVCACHE": "1"})[0] == 0


def test_help_lists_groups():
    code, out, _ = check("--help")
    assert code == 0 and "--enable_vmm_kvcache" in out and "[vmm]" in out


def _subprocess(*args):
    return subprocess.run([sys.executable, "-m", "xllm_vmm.cli", *args], capture_output=True,
                          text=True, cwd=ROOT)


def test_process_exit_code_and_no_torch_typer_or_pydantic_import():
    code = ("import sys, runpy; sys.argv = ['xllm-vmm', 'check-config', "
            f"{str(CONFIGS[0])!r}, '--format=json']\n"
            "from xllm_vmm.cli import main\n"
            "try:\n    main()\nexcept SystemExit as e:\n"
            "    bad = [m for m in ('torch', 'typer', 'pydantic') if m in sys.modules]\n"
            "    sys.stderr.write('LOADED=' + ','.join(bad))\n    raise\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert p.stderr.strip().endswith("LOADED=")


def test_typer_command_delegates():
    p = _subprocess("check-config", "--enable_vmm_kvcache=true", "--enable_task_pipeline=true")
    assert p.returncode == 1 and "SD-04" in p.stdout and "Traceback" not in p.stderr
    from typer.testing import CliRunner

    from xllm_vmm.cli.app import app

    r = CliRunner().invoke(app, ["check-config", "--enable_vmm_kvcache=true",
                                 "--enable_task_pipeline=true", "--no-env"])
    assert r.exit_code == 1 and "SD-04" in r.output


def test_flags_and_schema_commands():
    from typer.testing import CliRunner

    from xllm_vmm.cli.app import app

    r = CliRunner().invoke(app, ["flags", "--format", "json", "--group", "vmm"])
    assert r.exit_code == 0
    names = [f["name"] for f in json.loads(r.output)]
    assert names == ["enable_task_pipeline", "enable_vmm_kvcache", "enable_vmm_weights",
                     "vmm_elastic", "vmm_memory_reserve_bytes"]
    r = CliRunner().invoke(app, ["flags", "--format", "markdown", "--search", "reserve"])
    assert "| `--vmm_memory_reserve_bytes` | int64 (bytes) | `0` |" in r.output
    assert CliRunner().invoke(app, ["flags", "--group", "vm"]).exit_code == 2
    r = CliRunner().invoke(app, ["schema"])
    assert json.loads(r.output)["title"] == "xllm-vmm configuration"


def test_text_marks_warnings_apart_from_errors_and_github_levels():
    args = ("--enable_vmm_kvcache", "--vmm_elastic", "--max_memory_utilization=0.7",
            "--kv_cache_dtype=fp8")
    code, out, _ = check(*args)
    assert code == 1
    assert "    ✗ QK-01: " in out and "    ! EL-02: " in out and "✗ EL-02" not in out
    code, out, _ = check(*args, "--strict")
    assert "    ✗ EL-02: " in out and out.count("errors (") == 1 and "errors (2)" in out
    code, out, _ = check(*args, "--format", "github")
    levels = {line.split(" ", 1)[0] + line.split("title=")[1].split("::")[0]
              for line in out.splitlines() if line.startswith("::")}
    assert levels == {"::errorQK-01", "::warningEL-02"}
    code, out, _ = check(*args, "--format", "github", "--strict")
    assert out.count("::error ") == 2 and "::warning" not in out


HOST_OFFLOAD = ("--enable_vmm_kvcache", "--host_blocks_factor=4", "--max_cache_size=17179869184",
                "--model=Qwen/Qwen3-8B", "--nnodes=2")


def test_hk07_with_the_planner_counts_every_worker():
    # 113 slots of 150,994,944 bytes under the 16 GiB quota per worker; x4 = 68,249,714,688
    # bytes of host pool per worker; 2 workers need 136,499,429,376 > 120 GiB (the old
    # max_cache_size x factor = 64 GiB ignored the workers and fitted).
    code, out, _ = check(*HOST_OFFLOAD, "--device-memory=64GiB", "--host-memory=120GiB",
                         "--format", "json")
    f = next(f for f in json.loads(out)["inputs"][0]["findings"] if f["id"] == "HK-07")
    assert f["severity"] == "warning" and code == 0
    assert f["message"].startswith("HK-07: the host KV pool needs 136,499,429,376 bytes "
                                   "(127.12 GiB; 68,249,714,688 x 2 workers, each device KV "
                                   "capacity 17,062,428,672 x host_blocks_factor 4)")
    assert "(--host-memory)" in f["message"]
    assert f["flags"]["nnodes"] == 2
    # one worker fits the same host memory
    code, out, _ = check(*HOST_OFFLOAD[:-1], "--device-memory=64GiB", "--host-memory=120GiB",
                         "--format", "json")
    entry = json.loads(out)["inputs"][0]
    assert "HK-07" not in {f["id"] for f in entry["findings"]}
    assert "HK-07" not in {n["rule"] for n in entry["not_checked"]}


def test_hk07_default_host_memory_is_named_and_unknown_inputs_are_listed():
    code, out, _ = check(*HOST_OFFLOAD, "--host_blocks_factor=100000", "--device", "h200")
    assert code == 1  # CFG-DUP: the factor is given twice on one command line
    code, out, _ = check("--enable_vmm_kvcache", "--host_blocks_factor=100000",
                         "--max_cache_size=17179869184", "--model=Qwen/Qwen3-8B", "--device", "h200")
    assert code == 0 and "    ! HK-07: " in out
    assert "of host memory available (this host's available memory" in out
    code, out, _ = check("--enable_vmm_kvcache", "--host_blocks_factor=4", "--model=Qwen/Qwen3-8B")
    assert "? HK-07: the device memory is not known: pass --device-memory or --device PROFILE" \
        in out
    code, out, _ = check("--enable_vmm_kvcache", "--host_blocks_factor=4", "--device", "h200")
    assert "? HK-07: no --model given" in out


def test_el08_device_memory_from_a_profile():
    args = ("--enable_vmm_kvcache", "--vmm_elastic", "--vmm_memory_reserve_bytes=42949672960")
    assert "! EL-08: " in check(*args, "--device", "ascend-910b-32g")[1]
    assert "EL-08" not in check(*args, "--device", "ascend-910b-64g")[1]
    assert "? EL-08" in check(*args)[1]
    code, _, err = check(*args, "--device", "h300")
    assert code == 2 and "unknown device profile 'h300'" in err and "Traceback" not in err


def _model_dir_with_garbage_shard(tmp_path):
    from xllm_vmm.models.catalogue import read_catalogue_config

    d = tmp_path / "m1"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(read_catalogue_config("Qwen/Qwen3-8B")))
    (d / "model.safetensors").write_bytes(b"garbage")
    return d


def test_a_damaged_safetensors_shard_does_not_disable_model_rules(tmp_path):
    d = _model_dir_with_garbage_shard(tmp_path)
    code, out, _ = check(f"--model={d}", "--enable_vmm_kvcache", "--vmm_elastic",
                         "--max_cache_size=1048576", "--format=json")
    doc = json.loads(out)["inputs"][0]
    assert code == 1 and [f["id"] for f in doc["findings"]] == ["EL-06"]
    assert not doc["not_checked"]


def test_cmd_file_checks_the_engine_command_and_says_which(tmp_path):
    p = tmp_path / "l6.sh"
    p.write_text("/opt/xllm/bin/xllm --model=Qwen/Qwen3-8B --enable_vmm_kvcache=true "
                 "--enable_task_pipeline=true &\nsleep 30\n"
                 "curl --retry 5 --fail http://localhost:8010/health\n")
    code, out, _ = check("--cmd-file", str(p), "--format=json")
    doc = json.loads(out)["inputs"][0]
    assert code == 1 and [f["id"] for f in doc["findings"]] == ["SD-04"]
    assert doc["launch_command"] == f"{p}:1 (/opt/xllm/bin/xllm: the engine)"
    code, out, _ = check("--cmd-file", str(p))
    assert f"launch command checked: {p}:1" in out


def test_strict_lists_errors_and_warnings_under_one_heading():
    code, out, _ = check("--strict", "--enable_vmm_kvcache", "--vmm_elastic",
                         "--max_memory_utilization=0.5", "--enable_task_pipeline")
    assert code == 1 and out.count("errors (") == 1 and "errors (2)" in out
    assert "warnings (" not in out.split("implied")[0]


def test_a_device_listed_twice_is_a_finding_on_devices():
    code, out, _ = check("--devices=npu:0,npu:1,npu:0", "--format=json")
    f = json.loads(out)["inputs"][0]["findings"]
    assert code == 1 and [x["id"] for x in f] == ["CFG-TYPE"]
    assert f[0]["flags"] == {"devices": "npu:0,npu:1,npu:0"}
    assert "device 'npu:0' is listed twice" in f[0]["message"]


@pytest.mark.parametrize("option", ["--device-memory", "--host-memory"])
def test_memory_above_one_pib_is_a_usage_error(option):
    code, _, err = check(option, "2048TiB")
    assert code == 2 and f"{option} 2048TiB is more than 1 PiB: no machine has that" in err


def test_model_path_that_is_not_a_model_directory_is_a_warning_and_strict_fails(tmp_path):
    """CFG-MODEL: a --model that is a local path (/ . ~, or an existing parent directory) but
    not a readable model directory is a warning naming model and its source, with the closest
    catalogue names (CI checks scripts whose paths exist only on the serving host); --strict
    fails on it; a hub-style name not in the catalogue stays "not checked"."""
    code, out, _ = check("--model=/nonexistent", "--enable_vmm_kvcache=true", "--format=json")
    doc = json.loads(out)["inputs"][0]
    assert code == 0 and [f["id"] for f in doc["findings"]] == ["CFG-MODEL"]
    f = doc["findings"][0]
    assert f["severity"] == "warning" and f["flags"] == {"model": "/nonexistent"}
    assert f["sources"]["model"]["kind"] == "cli"
    assert f["message"] == ("CFG-MODEL: model=/nonexistent (command line) is a local path but "
                            "not a readable model directory here: model directory does not "
                            "exist; its model rules are not checked")
    code, _, _ = check("--model=/nonexistent", "--enable_vmm_kvcache=true", "--strict",
                       "--format=json")
    assert code == 1
    (tmp_path / "qwen3").mkdir()
    code, out, _ = check(f"--model={tmp_path}/qwen3", "--format=json", "--strict")
    f = json.loads(out)["inputs"][0]["findings"][0]
    assert code == 1 and f["id"] == "CFG-MODEL"
    assert f["message"].endswith("not a readable model directory here: no config.json in the "
                                 "model directory; its model rules are not checked")
    assert "closest: Qwen/Qwen3-8B" in f["hint"]
    code, out, _ = check("--model=Qwen/Qwen3-9B", "--enable_vmm_kvcache=true", "--format=json")
    doc = json.loads(out)["inputs"][0]
    assert code == 0 and doc["findings"] == []
    assert [n["rule"] for n in doc["not_checked"]] == ["PC-02", "HY-01"]
    code, out, _ = check("--explain", "CFG-MODEL")
    assert code == 0 and out.startswith(
        "CFG-MODEL (input check, warning, an error with --strict): a --model that is")


def test_explain_unknown_id_suggests_and_lists_the_ids():
    code, out, err = check("--explain", "XX-99")
    lines = err.splitlines()
    assert code == 2 and out == "" and lines[0] == "error: no rule 'XX-99'"
    assert lines[1].startswith("Rule ids: AD-01, AD-02, ") and "EL-08" in lines[1]
    assert "input checks: CFG-READ, " in lines[1] and "CFG-MODEL" in lines[1]
    code, _, err = check("--explain", "EL-99")
    assert err.splitlines()[0] == "error: no rule 'EL-99'; did you mean EL-08, EL-07, EL-06?"


MARKDOWN = """# Serving

It's easy: don't worry about the quotes in prose.

```bash
pip install xllm-vmm
xllm-vmm serve --model /m --block_size=16 \\
  --bogus_flag=1
```

```python
print("it's python, never read as shell")
```

```console
$ xllm-vmm serve --model /m --block_sise=32
ready at http://127.0.0.1:8010
```
"""


def test_a_markdown_cmd_file_is_read_for_its_fenced_shell_blocks(tmp_path):
    p = tmp_path / "README.md"
    p.write_text(MARKDOWN)
    code, out, _ = check("--cmd-file", str(p))
    assert code == 1
    assert "No closing quotation" not in out and "commands seen" not in out
    assert "(block at line 6)" in out and "(block at line 16)" in out
    assert f"unknown flag 'bogus_flag' (command line {p}:8:" in out
    assert f"unknown flag 'block_sise' (command line {p}:16:29)" in out  # the prompt's columns


def test_a_markdown_file_without_a_launch_command_is_not_a_script(tmp_path):
    p = tmp_path / "notes.md"
    p.write_text("# Notes\n\nIt's prose only.\n\n```sh\nls -l\n```\n")
    code, out, _ = check("--cmd-file", str(p))
    assert code != 0
    assert f"{p} is a Markdown document, not a script" in out and "No closing" not in out
    bare = tmp_path / "prose.md"
    bare.write_text("# Title\n\nIt's only prose.\n")
    code, out, _ = check("--cmd-file", str(bare))
    assert code != 0 and "has no fenced shell block" in out
