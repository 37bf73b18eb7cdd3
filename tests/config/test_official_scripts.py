"""The launch scripts published in the engine's documentation (tests/config/data/official, their
text as published; README.md there names each source) check with only the findings they have."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from xllm_vmm.cli.check_config import run

DATA = Path(__file__).parent / "data" / "official"

#: script -> (exit code, finding ids). CFG-MODEL: the model paths exist on the serving host only
#: (a warning). disagg_pd_decode.sh as published has blanks after the backslash that ends its
#: etcd_addr line: bash ends the command there and runs the last four flags as a command of
#: their own, a real defect the checker reports (CFG-SHELL). CFG-SERVE: the MTP scripts
#: (mtp_deepseek_v3, glm5_single, the GLM-5 PD pair) run speculative decoding across workers,
#: which the engine runs and xllm-vmm serve refuses (a warning: the exit code stays 0; an
#: error with --strict); their ep_size > 1 alone is supported (expert groups).
EXPECTED = {
    "launch_xllm_npu.sh": (0, ["CFG-MODEL"]),
    "launch_xllm_cuda.sh": (0, ["CFG-MODEL"]),
    "launch_xllm_mlu.sh": (0, ["CFG-MODEL"]),
    "launch_xllm_dcu.sh": (0, ["CFG-MODEL"]),
    "multi_machine_1.sh": (0, ["CFG-MODEL"]),
    "multi_machine_2.sh": (0, ["CFG-MODEL"]),
    "mtp_deepseek_v3.sh": (0, ["CFG-MODEL", "CFG-SERVE"]),
    "mtp_mimo_cuda.sh": (0, ["CFG-MODEL"]),
    "disagg_pd_prefill.sh": (0, []),
    "disagg_pd_decode.sh": (1, ["CFG-SHELL"]),
    "glm5_single.sh": (0, ["CFG-MODEL", "CFG-SERVE"]),
    "glm5_node0.sh": (0, ["CFG-UNRESOLVED"]),
    "glm5_node1.sh": (0, ["CFG-UNRESOLVED"]),
    "glm5_pd_prefill.sh": (0, ["CFG-MODEL", "CFG-SERVE"]),
    "glm5_pd_decode.sh": (0, ["CFG-MODEL", "CFG-SERVE"]),
    # no engine command: unreadable input, exit 2
    "mtp_export_deepseek_v3.sh": (2, ["CFG-SYNTAX"]),
    "mtp_export_model_type.sh": (2, ["CFG-SYNTAX"]),
    "mtp_glm4_moe.sh": (2, ["CFG-SYNTAX"]),
    "disagg_pd_service.sh": (2, ["CFG-SYNTAX"]),
    "glm5_env.sh": (2, ["CFG-SYNTAX"]),
}


def check(*argv: str) -> tuple[int, dict]:
    out = io.StringIO()
    code = run([*argv, "--format=json"], out=out, err=io.StringIO(), env={})
    return code, json.loads(out.getvalue())


def test_every_script_is_covered():
    assert sorted(EXPECTED) == sorted(p.name for p in DATA.glob("*.sh"))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_official_script(name):
    code, doc = check(str(DATA / name))
    (entry,) = doc["inputs"]
    assert (code, [f["id"] for f in entry["findings"]]) == EXPECTED[name], entry["findings"]


def test_loop_values_are_the_first_iteration_and_the_report_says_so():
    code, doc = check(str(DATA / "multi_machine_2.sh"))
    (entry,) = doc["inputs"]
    flags = {k: v["value"] for k, v in entry["resolved"].items()}
    assert flags["port"] == 18000 and flags["devices"] == "npu:0"
    assert flags["node_rank"] == 16  # $((i + LOCAL_NODES)) with i=0
    assert flags["nnodes"] == 32 and flags["host"] == "456.456.456.456"
    assert any("first iteration (i=0)" in n for n in entry["launch_notes"])
    assert any("escaped blank" in n for n in entry["launch_notes"])


def test_no_launch_command_names_the_commands_seen():
    code, doc = check(str(DATA / "mtp_export_deepseek_v3.sh"))
    msg = doc["inputs"][0]["findings"][0]["message"]
    assert code == 2 and "no launch command" in msg and "python3 (line 1)" in msg
    code, doc = check(str(DATA / "disagg_pd_service.sh"))
    assert "xllm_master_serving (line 1)" in doc["inputs"][0]["findings"][0]["message"]


def test_unset_variables_are_not_checked_and_listed():
    code, doc = check(str(DATA / "glm5_node0.sh"))
    (entry,) = doc["inputs"]
    assert code == 0
    (value,) = [n for n in entry["not_checked"] if n["flag"]]
    assert value["flag"] == "model" and value["text"] == "--model $MODEL_PATH"
    assert "$MODEL_PATH is not set in the script" in value["reason"]
    assert "program is not known here ($XLLM_PATH" in entry["launch_command"]


@pytest.mark.parametrize("name, workers", [
    ("multi_machine_1.sh", 32), ("mtp_deepseek_v3.sh", 16), ("launch_xllm_npu.sh", 1),
])
def test_plan_sizes_the_engines_worker_count(name, workers):
    # nnodes is the total number of processes (one per device) of the service
    from typer.testing import CliRunner

    from xllm_vmm.cli.app import app

    r = CliRunner().invoke(app, ["plan", str(DATA / name), "--model=deepseek-ai/DeepSeek-V3",
                                 "--format=json", "--host-memory=1TiB"], env={})
    assert r.exit_code in (0, 1), r.output
    d = json.loads(r.stdout)
    assert d["workers"] == workers and len(d["per_worker"]) == workers
