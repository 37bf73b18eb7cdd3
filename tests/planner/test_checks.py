"""Sizing rules decided with the planner (HK-07, EL-08), plan over several inputs, and a separate
draft model read from its own config.json."""

import json

import pytest
from typer.testing import CliRunner

from xllm_vmm.cli.app import app
from xllm_vmm.config import load
from xllm_vmm.config.rules import SIZING_PENDING
from xllm_vmm.kvcache.host_pool import host_pool_size
from xllm_vmm.models.catalogue import read_catalogue_config
from xllm_vmm.planner.checks import Memory, check_sizing

GiB = 1 << 30
SLOT = 72 * 2 * (1 << 20)  # Qwen3-8B: one 2 MiB page in each of 72 tensors
BLOCK = 147_456 * 128  # Qwen3-8B: one block of all 72 tensors (1 worker)
OFFLOAD = ["--enable_vmm_kvcache", "--host_blocks_factor=4", "--max_cache_size=17179869184",
           "--model=Qwen/Qwen3-8B"]

runner = CliRunner()


def plan(*args):
    return runner.invoke(app, ["plan", *args], env={})


def test_hk07_counts_every_worker_and_names_the_host_memory_source():
    cfg = load(OFFLOAD + ["--nnodes=2"])
    c = check_sizing(cfg, device=Memory(64 * GiB, "--device-memory"),
                     host=Memory(120 * GiB, "--host-memory"))
    # 16 GiB quota: floor(17,179,869,184 / 150,994,944) = 113 slots per worker; x4 host pool
    w = c.plan.workers[0]
    assert w.arena_bytes == 113 * SLOT == 17_062_428_672
    assert w.host_pool_bytes == 4 * 113 * SLOT == 68_249_714_688
    f = [x for x in c.report.findings if x.id == "HK-07"]
    assert len(f) == 1 and f[0].severity == "warning"
    reason = next(r for r in c.plan.reasons if r.code == "HK-07")
    assert f[0].message == "HK-07: " + reason.message and f[0].hint == reason.hint
    assert "136,499,429,376 bytes" in f[0].message and "(--host-memory)" in f[0].message
    assert "cap each worker's device KV capacity at 16,106,127,360 bytes" in f[0].hint
    assert "HK-07" not in c.report.not_checked
    one = check_sizing(load(OFFLOAD), device=Memory(64 * GiB, "--device-memory"),
                       host=Memory(120 * GiB, "--host-memory"))
    assert "HK-07" not in one.report.rule_ids() and "HK-07" not in one.report.not_checked


def test_hk07_host_pool_is_the_serving_host_pool():
    cfg = load(["--enable_vmm_kvcache", "--host_blocks_factor=2.5", "--max_cache_size=17179869184",
                "--model=Qwen/Qwen3-8B"])
    c = check_sizing(cfg, device=Memory(64 * GiB, "x"), host=Memory(1 << 50, "x"))
    w = c.plan.workers[0]
    served = host_pool_size(w.arena_bytes, 2.5, BLOCK)
    assert w.host_pool_bytes == served.bytes == served.blocks * BLOCK


def test_hk07_not_checked_reasons():
    dev, host = Memory(64 * GiB, "d"), Memory(GiB, "h")
    assert check_sizing(load(OFFLOAD), host=host).report.not_checked["HK-07"].startswith(
        "the device memory is not known: pass --device-memory or --device PROFILE")
    assert check_sizing(load(OFFLOAD[:-1]), device=dev, host=host).report.not_checked[
        "HK-07"] == "no --model given"
    bad = check_sizing(load(OFFLOAD + ["--nnodes=3"]), device=dev, host=host)
    assert bad.report.not_checked["HK-07"].startswith(
        "the configuration cannot be sized: 3 workers cannot split")
    # without host offload HK-07 does not apply and no plan is made
    off = check_sizing(load(["--model=Qwen/Qwen3-8B"]), device=dev, host=host)
    assert off.plan is None and "HK-07" not in off.report.not_checked
    assert SIZING_PENDING not in off.report.not_checked.values()


def test_plan_lists_hk07_once_as_the_check_config_finding():
    r = plan(*OFFLOAD, "--nnodes=2", "--device-memory=64GiB", "--host-memory=120GiB",
             "--format=json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert [x for x in d["reasons"] if x["code"] == "HK-07"] == []
    hk = [f for f in d["config_findings"] if f["id"] == "HK-07"]
    assert len(hk) == 1 and "136,499,429,376 bytes" in hk[0]["message"]


def test_plan_several_inputs_one_report_each_worst_exit_code(tmp_path):
    ok = tmp_path / "ok.toml"
    ok.write_text('model = "Qwen/Qwen3-8B"\nenable_vmm_kvcache = true\n')
    big = tmp_path / "big.toml"
    big.write_text('model = "deepseek-ai/DeepSeek-V3"\nnnodes = 8\n')
    r = plan(str(ok), str(big), "--cmd", "xllm --model=Qwen/Qwen3-8B --nnodes=2",
             "--format", "json", "--host-memory=256GiB")
    assert r.exit_code == 1, r.output
    d = json.loads(r.stdout)
    assert d["schema_version"] == 1 and d["tool"] == "xllm-vmm plan" and d["exit_code"] == 1
    assert [(i["input"], i["exit_code"], i["verdict"]) for i in d["inputs"]] == [
        (str(ok), 0, "fits"), (str(big), 1, "does_not_fit"), ("--cmd #1", 0, "fits")]
    assert d["inputs"][0]["plan"]["mode"] == "fixed_vmm"
    assert d["inputs"][2]["plan"]["workers"] == 2
    # an unreadable input is exit 2, reported in its entry; the others are still planned
    r = plan(str(ok), str(tmp_path / "missing.toml"), "--format=json", "--host-memory=1TiB")
    d = json.loads(r.stdout)
    assert r.exit_code == 2 and d["exit_code"] == 2
    assert d["inputs"][0]["verdict"] == "fits" and d["inputs"][1]["plan"] is None
    assert "cannot read" in d["inputs"][1]["error"]
    # table: one section per input and a summary line
    r = plan(str(ok), str(big), "--host-memory=1TiB")
    assert r.exit_code == 1 and "2 input(s): 1 fit" in r.stdout
    assert r.stdout.count("xllm-vmm plan: ") == 2
    # a single input keeps the single-plan document
    r = plan(str(ok), "--format=json", "--host-memory=1TiB")
    assert list(json.loads(r.stdout))[:3] == ["schema_version", "model", "workers"]


def test_plan_positional_model_name_says_how_to_pass_it():
    r = plan("Qwen/Qwen3-8B")
    assert r.exit_code == 2 and "pass --model=Qwen/Qwen3-8B" in r.stderr
    assert "Traceback" not in r.output


@pytest.fixture
def draft_dir(tmp_path):
    cfg = read_catalogue_config("Qwen/Qwen3-8B")
    cfg["num_hidden_layers"] = 1
    d = tmp_path / "draft"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_draft_model_directory_is_sized_from_its_config(draft_dir):
    spec_args = ("--model=Qwen/Qwen3-8B", "--num_speculative_tokens=3",
                 "--speculative_algorithm=MTP", "--enable_vmm_kvcache", "--format=json",
                 "--host-memory=1TiB")
    r = plan(*spec_args, f"--draft_model={draft_dir}")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    draft = d["model"]["draft"]
    assert draft["layers"] == 1 and draft["source"] == str(draft_dir / "config.json")
    w = d["per_worker"][0]
    groups = {g["name"]: g for g in w["groups"]}
    assert list(groups) == ["attn", "draft"]
    assert groups["draft"]["tensors"] == 2 and groups["draft"]["bytes_per_token"] == 4096
    assert w["kv_bytes_per_token"] == 147_456 + 4096
    assert w["weights_bytes"] == 16_381_470_720 + draft["weights_bytes"]
    assert not [x for x in d["reasons"] if x["code"] == "DRAFT"]
    # not a directory: the target's MTP layers (Qwen3-8B has none) -> no draft group
    d = json.loads(plan(*spec_args, "--draft_model=/models/mtp").stdout)
    assert d["model"]["draft"] is None
    assert [g["name"] for g in d["per_worker"][0]["groups"]] == ["attn"]
    assert [x["code"] for x in d["reasons"]] == ["DRAFT"]  # a sizing note, not a rule finding


def test_unreadable_draft_config_is_a_clear_error(draft_dir):
    (draft_dir / "config.json").write_text("{oops")
    r = plan("--model=Qwen/Qwen3-8B", "--num_speculative_tokens=3", "--speculative_algorithm=MTP",
             f"--draft_model={draft_dir}")
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert "draft_model (from command line): config.json is not valid JSON" in r.stderr


def test_hk07_never_recommends_a_factor_that_turns_the_tier_off():
    c = check_sizing(load(["--model=Qwen/Qwen3-8B", "--enable_vmm_kvcache",
                           "--host_blocks_factor=1000000"]),
                     device=Memory(64 * GiB, "--device-memory"), host=Memory(GiB, "--host-memory"))
    hint = next(r for r in c.plan.reasons if r.code == "HK-07").hint
    assert "lower host_blocks_factor" not in hint
    # The cap would be 1,073 bytes, below one slot (150,994,944): the tier cannot fit at all.
    assert hint == ("the host tier cannot fit at host_blocks_factor 1e+06: even the least device "
                    "KV capacity (150,994,944 bytes per worker) would need "
                    "150,994,944,000,000 bytes of host memory, and no factor above 1 fits at the "
                    "current capacity (at most 0.02 would; 1 or less turns the host tier off, "
                    "HK-03): turn the host tier off (host_blocks_factor=0) or give the host more "
                    "memory; serving refuses this configuration")
    # A factor above 1 fits the current capacity, but no max_cache_size cap would.
    c = check_sizing(load(["--model=Qwen/Qwen3-8B", "--enable_vmm_kvcache",
                           "--host_blocks_factor=1000000"]),
                     device=Memory(64 * GiB, "--device-memory"),
                     host=Memory(100 * GiB, "--host-memory"))
    hint = next(r for r in c.plan.reasons if r.code == "HK-07").hint
    assert hint.startswith("the host tier cannot fit at host_blocks_factor 1e+06: even the least "
                           "device KV capacity (150,994,944 bytes per worker) would need ")
    assert hint.endswith("; lower host_blocks_factor to at most 2.85 (the largest that fits at the "
                         "current capacity), or turn the host tier off (host_blocks_factor=0); "
                         "serving refuses this configuration")
    # max_cache_size unset (0): "set" it, not "lower" it; the cap is above one slot.
    c = check_sizing(load(["--model=Qwen/Qwen3-8B", "--enable_vmm_kvcache",
                           "--host_blocks_factor=10"]),
                     device=Memory(64 * GiB, "--device-memory"),
                     host=Memory(20 * GiB, "--host-memory"))
    hint = next(r for r in c.plan.reasons if r.code == "HK-07").hint
    assert hint.startswith("no host_blocks_factor above 1 fits (at most 0.57 would, and a factor "
                           "of 1 or less turns the host tier off, HK-03): set max_cache_size so "
                           "each worker's device KV capacity is at most 2,147,483,648 bytes")
    # A factor above 1 that fits is still recommended, rounded down so that it fits.
    c = check_sizing(load(OFFLOAD), device=Memory(64 * GiB, "--device-memory"),
                     host=Memory(40 * GiB, "--host-memory"))
    hint = next(r for r in c.plan.reasons if r.code == "HK-07").hint
    factor = float(hint.split("at most ")[1].split(",")[0])
    assert factor > 1 and factor * c.plan.workers[0].arena_bytes <= 40 * GiB


def test_verdict_says_serve_refuses_a_host_pool_that_does_not_fit():
    """HK-07 stays a warning in plan (``check-config --explain HK-07``), but the verdict must not read as a plain
    "fits": JSON lists it in serve_refuses and the table says serve refuses it."""
    base = ("--model=Qwen/Qwen3-8B", "--enable_vmm_kvcache", "--host_blocks_factor=2",
            "--device-memory=64GiB")
    d = json.loads(plan(*base, "--host-memory=1GiB", "--format=json").stdout)
    assert d["verdict"] == "fits" and d["serve_refuses"] == ["HK-07"]
    d = json.loads(plan(*base, "--host-memory=1TiB", "--format=json").stdout)
    assert d["verdict"] == "fits" and d["serve_refuses"] == []
    r = plan(*base, "--host-memory=1GiB")
    assert "fits on the device, but serve refuses it (HK-07" in " ".join(r.stdout.split())


def test_memory_hint_offers_a_higher_ratio_only_when_the_device_could_hold_the_weights():
    def hint(mem):
        d = json.loads(plan("--model=Qwen/Qwen3-8B", f"--device-memory={mem}",
                            "--format=json").stdout)
        return [r["hint"] for r in d["reasons"] if r["code"] == "MEMORY"][0]
    assert "max_memory_utilization" not in hint("1GiB")  # 16.4 GB of weights: no ratio helps
    assert hint("18GiB").endswith("or a higher max_memory_utilization")


def test_plan_sizes_mean_what_flag_sizes_mean():
    """plan's --device-memory / --host-memory use the flags' size parser: `64G` is 64 GiB in
    both (it was 64×1000³ in plan), `80GB` is decimal in both."""
    from xllm_vmm.config.values import parse_size
    from xllm_vmm.planner import parse_bytes

    for text in ("64G", "64GiB", "80GB", "512MiB", "1.5GiB", "1PiB", "123"):
        assert parse_bytes(text, what="--device-memory") == parse_size(text)
    assert parse_bytes("64G", what="--device-memory") == 64 * 1024**3
    d = json.loads(plan("--model=Qwen/Qwen3-8B", "--device-memory=64G", "--format=json").stdout)
    assert d["device"]["total_bytes"] == 68_719_476_736
