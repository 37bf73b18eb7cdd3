"""CFG-SERVE: what the engine runs but ``xllm-vmm serve`` refuses across several workers.

One home (``xllm_vmm.config.parallel.serve_refusals``): check-config reports each as a warning
(an error with ``--strict``), ``plan`` lists it in ``serve_refuses``, and the distributed start-up
(``engine.distributed.topology.topology_of``) raises the same message. Each trigger has its
nearest non-trigger beside it."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from xllm_vmm.cli.app import app
from xllm_vmm.cli.check_config import run as check_config
from xllm_vmm.config import ConfigError, load
from xllm_vmm.config.parallel import SERVE_REFUSES_ID, serve_refusals, spawns_per_device
from xllm_vmm.config.rules import check_all
from xllm_vmm.engine.distributed.topology import topology_of
from xllm_vmm.planner.sizing import SERVE_ERROR_RULES

OFFICIAL = Path(__file__).parent / "data" / "official"

#: (trigger flags, the flag named, nearest non-trigger flags)
CASES = [
    (["--nnodes=2", "--dp_size=2"], "dp_size", ["--nnodes=2", "--dp_size=1"]),
    # ep_size alone is supported (expert groups); with dp_size > 1 it is refused — the dp_size
    # refusal comes first, then this one (tested at once below); the nearest non-trigger is
    # ep_size over every worker without dp_size
    (["--nnodes=2", "--num_speculative_tokens=1"], "num_speculative_tokens",
     ["--nnodes=2", "--num_speculative_tokens=0"]),
    (["--nnodes=1", "--devices=npu:0,npu:1", "--num_speculative_tokens=2"],
     "num_speculative_tokens", ["--nnodes=1", "--devices=npu:0,npu:1", "--ep_size=2"]),
    (["--nnodes=2", "--devices=npu:0,npu:1"], "devices", ["--nnodes=1", "--devices=npu:0,npu:1"]),
    (["--nnodes=2", "--node_rank=1", "--devices=npu:0,npu:1"], "devices",
     ["--nnodes=2", "--node_rank=1", "--devices=npu:1"]),
    (["--devices=npu:0,npu:1", "--node_rank=0"], "devices", ["--devices=npu:0,npu:1"]),
    # the host KV tier is served across workers (its copies fan out): no trigger left
]


def serve_findings(*argv: str) -> list:
    return [f for f in check_all(load(list(argv))).findings if f.id == SERVE_REFUSES_ID]


@pytest.mark.parametrize("trigger, flag, near", CASES)
def test_each_refusal_is_a_warning_naming_its_flag_and_source(trigger, flag, near):
    (f,) = serve_findings(*trigger)
    assert f.severity == "warning" and list(f.flags) == [flag]
    assert f.sources[flag].kind == "cli" and "(command line)" in f.message
    assert "xllm-vmm serve" in f.message and f.hint
    assert serve_findings(*near) == []


@pytest.mark.parametrize("trigger, flag, near", CASES)
def test_start_up_raises_the_same_refusal(trigger, flag, near):
    """The distributed start-up calls the same predicate: the same flag, the same message."""
    cfg = load(trigger)
    with pytest.raises(ConfigError) as e:
        topology_of(cfg, {})
    (f,) = e.value.findings
    assert (f.id, f.severity, list(f.flags)) == (SERVE_REFUSES_ID, "error", [flag])
    (checked,) = serve_findings(*trigger)
    assert checked.message.startswith(f.message) and checked.hint == f.hint
    topology_of(load(near), {})  # the nearest non-trigger starts (or is one worker: None)


def test_every_refusal_is_reported_at_once():
    argv = ["--nnodes=2", "--dp_size=2", "--ep_size=2", "--devices=npu:0,npu:1",
            "--host_blocks_factor=4", "--num_speculative_tokens=1"]
    want = ["dp_size", "ep_size", "num_speculative_tokens", "devices"]
    assert [list(f.flags)[0] for f in serve_findings(*argv)] == want
    with pytest.raises(ConfigError) as e:
        topology_of(load(argv), {})
    assert [list(f.flags)[0] for f in e.value.findings] == want


def test_ep_size_alone_is_served_and_with_dp_size_says_why_not():
    assert serve_findings("--nnodes=4", "--ep_size=2") == []
    assert serve_findings("--nnodes=4", "--ep_size=4") == []
    topology_of(load(["--nnodes=4", "--ep_size=2"]), {})  # starts (ep 2 of 4 workers)
    dp, ep = serve_findings("--nnodes=4", "--ep_size=2", "--dp_size=2")
    assert list(ep.flags) == ["ep_size"] and "all-to-all" in ep.message
    assert "ep_size alone is supported" in ep.message


def test_the_host_tier_across_workers_is_served():
    assert serve_findings("--nnodes=2", "--host_blocks_factor=2") == []
    topology_of(load(["--nnodes=2", "--host_blocks_factor=2"]), {})


def test_one_worker_has_nothing_to_refuse():
    assert serve_refusals(load(["--host_blocks_factor=4", "--devices=npu:0"])) == []
    assert serve_findings("--host_blocks_factor=4") == []


def test_spawn_per_device_is_the_supported_several_devices_form():
    assert spawns_per_device(load(["--devices=cuda:0,cuda:1"]))
    assert not spawns_per_device(load(["--devices=cuda:0,cuda:1", "--nnodes=2"]))
    assert not spawns_per_device(load(["--devices=cuda:0,cuda:1", "--node_rank=0"]))
    assert not spawns_per_device(load(["--devices=cuda:0"]))
    assert not spawns_per_device(load(["--devices=cuda:0,cuda:0"]))  # invalid: CFG-TYPE's


def check(*argv: str) -> tuple[int, dict]:
    out = io.StringIO()
    code = check_config([*argv, "--format=json"], out=out, err=io.StringIO(), env={})
    return code, json.loads(out.getvalue())


def test_exit_code_warning_by_default_error_with_strict():
    code, doc = check("--nnodes=2", "--dp_size=2")
    assert code == 0 and [f["id"] for f in doc["inputs"][0]["findings"]] == ["CFG-SERVE"]
    assert check("--nnodes=2", "--dp_size=2", "--strict")[0] == 1
    assert check("--nnodes=2", "--dp_size=1", "--strict")[0] == 0


def test_official_scripts_on_the_real_engine_stay_exit_0_and_fail_strict():
    """glm5_single.sh runs MTP (num_speculative_tokens=1) with ep_size=8 over its devices:
    the speculation is a warning here (ep_size alone is served), never exit 1 unless --strict
    (the script is valid for the engine itself)."""
    code, doc = check(str(OFFICIAL / "glm5_single.sh"))
    found = [f for f in doc["inputs"][0]["findings"] if f["id"] == "CFG-SERVE"]
    assert code == 0 and [list(f["flags"]) for f in found] == [["num_speculative_tokens"]]
    assert check(str(OFFICIAL / "glm5_single.sh"), "--strict")[0] == 1


def test_plan_fits_but_lists_it_in_serve_refuses():
    assert SERVE_REFUSES_ID in SERVE_ERROR_RULES
    runner = CliRunner()
    base = ["plan", "--model=Qwen/Qwen3-8B", "--nnodes=2", "--device-memory=64GiB"]
    d = json.loads(runner.invoke(app, [*base, "--dp_size=2", "--format=json"], env={}).stdout)
    assert d["verdict"] == "fits" and d["serve_refuses"] == ["CFG-SERVE"]
    d = json.loads(runner.invoke(app, [*base, "--format=json"], env={}).stdout)
    assert d["verdict"] == "fits" and d["serve_refuses"] == []
    text = " ".join(runner.invoke(app, [*base, "--dp_size=2"], env={}).stdout.split())
    assert "fits on the device, but serve refuses it" in text and "(CFG-SERVE: see below)" in text
