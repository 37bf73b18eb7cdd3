"""Every configuration rule id (``check-config --explain``): a configuration that triggers it and the nearest one that does not."""

import re
from pathlib import Path

import pytest

from xllm_vmm.config import load
from xllm_vmm.config.rules import RULES, check, check_all, find_model

KV = "--enable_vmm_kvcache=true"
W = "--enable_vmm_weights=true"
EL = "--vmm_elastic=true"
MIB = 1024 * 1024


def run(*args, model=None, **kw):
    cfg = load(list(args) + ([f"--model={model}"] if model else []))
    return check_all(cfg, **kw)


def errors(rep):
    return [f.id for f in rep.findings if f.severity == "error"]


def warnings(rep):
    return [f.id for f in rep.findings if f.severity == "warning"]


def implied(rep):
    return {i.rule: i for i in rep.implied}


# (rule id, triggering args, nearest non-triggering args, kind) for config rules
CASES = [
    ("VMM-01", [KV, "--devices=mlu:0"], [KV, "--devices=npu:0,npu:1"], "error"),
    ("VMM-06", ["--vmm_elastic=true"], [KV, EL], "warning"),
    ("W-03", [W], [W, EL], "error"),
    ("W-05", [W, EL, "--num_speculative_tokens=2", "--speculative_algorithm=DFlash",
              "--draft_model=/d", "--backend=llm"],
     [W, EL, "--num_speculative_tokens=0", "--speculative_algorithm=DFlash", "--draft_model=/d",
      "--backend=llm"], "error"),
    ("PC-03", [KV, "--enable_service_routing=true"],
     [KV, "--enable_service_routing=true", "--enable_prefix_cache=false"], "warning"),
    ("HK-02", ["--host_blocks_factor=2", "--noenable_prefix_cache"],
     ["--host_blocks_factor=2", "--enable_prefix_cache"], "warning"),
    ("HK-03", ["--host_blocks_factor=1"], ["--host_blocks_factor=1.5"], "warning"),
    ("HK-04", [KV, "--host_blocks_factor=2", "--kv_cache_dtype=int8"],
     ["--host_blocks_factor=2", "--kv_cache_dtype=int8"], "error"),
    ("HK-08", ["--host_blocks_factor=-0.5"], ["--host_blocks_factor=0"], "error"),
    ("SD-02", [KV, "--speculative_algorithm=Eagle3"], ["--speculative_algorithm=Eagle3"], "error"),
    ("SD-03", [KV, "--enable_disagg_pd", "--num_speculative_tokens=1", "--draft_model=/m"],
     [KV, "--enable_disagg_pd", "--num_speculative_tokens=0", "--draft_model=/m"], "error"),
    ("SD-04", [KV, "--enable_task_pipeline=true"], ["--enable_task_pipeline=true"], "error"),
    ("SD-05", ["--num_speculative_tokens=3", "--speculative_algorithm=MTP"],
     ["--num_speculative_tokens=3", "--speculative_algorithm=MTP", "--draft_model=/models/mtp"],
     "error"),
    ("QK-01", [KV, "--kv_cache_dtype=fp8"], [KV, "--kv_cache_dtype=auto"], "error"),
    ("EL-02", [KV, EL, "--max_memory_utilization=0.75"], [KV, EL], "warning"),
    ("EL-03", ["--max_memory_utilization=0"], ["--max_memory_utilization=1"], "error"),
    ("EL-04", [KV, EL, "--max_memory_utilization=1.5"], [KV, EL, "--max_memory_utilization=1"],
     "error"),
    ("EL-05", ["--max_cache_size=-1"], ["--max_cache_size=0"], "error"),
    ("PD-01", [KV, EL, "--enable_disagg_pd", "--kv_cache_transfer_type=Mooncake"],
     [KV, "--enable_disagg_pd", "--kv_cache_transfer_type=Mooncake",
      "--max_memory_utilization=0.8"], "error"),
]


@pytest.mark.parametrize("rule_id,trigger,near,severity", CASES, ids=[c[0] for c in CASES])
def test_config_rule_triggers_and_nearest_does_not(rule_id, trigger, near, severity):
    rep = run(*trigger)
    got = errors(rep) if severity == "error" else warnings(rep)
    assert rule_id in got, rep.findings
    finding = next(f for f in rep.findings if f.id == rule_id)
    assert finding.message.startswith(f"{rule_id}: ")
    assert finding.hint
    # every flag the finding names carries its value and provenance
    for name, src in finding.sources.items():
        assert finding.flags[name] == rep.resolved[name] or src.kind == "derived"
    assert rule_id not in run(*near).rule_ids()


def test_vmm01_names_supported_kinds_and_source():
    rep = run(KV, "--devices=dcu:0")
    f = next(f for f in rep.findings if f.id == "VMM-01")
    assert "dcu" in f.message and "npu, cuda, cpu" in f.hint
    assert f.sources["devices"].kind == "cli"
    for ok in ("cuda:0", "cpu", "auto", "", "npu:0,npu:1"):
        assert "VMM-01" not in run(KV, f"--devices={ok}").rule_ids()


def test_bad_devices_syntax_is_a_type_error():
    rep = run(KV, "--devices=npu:x")
    assert [f.id for f in rep.findings] == ["CFG-TYPE"]
    assert "npu:x" in rep.findings[0].message


def test_vmm02_shared_pool_and_vmm03_physical_kv():
    both = implied(run(KV, W, "--backend=llm"))
    assert both["VMM-02"].key == "vmm_pool" and both["VMM-02"].value == "shared"
    assert "VMM-03" not in both
    only_w = implied(run(W, EL, "--backend=llm"))
    assert only_w["VMM-03"].value == "physical" and "VMM-02" not in only_w


def test_vmm04_manual_loader_derived_and_explicit_false_warns():
    rep = run(W, EL, "--backend=llm")
    assert rep.resolved["enable_manual_loader"] is True
    src = rep.resolved.provenance("enable_manual_loader")
    assert (src.kind, src.rule) == ("derived", "VMM-04")
    assert warnings(rep) == []
    rep = run(W, EL, "--backend=llm", "--noenable_manual_loader")
    assert warnings(rep) == ["VMM-04"]
    assert rep.resolved["enable_manual_loader"] is True
    assert "VMM-04" not in run(KV).rule_ids() and "VMM-04" not in implied(run(KV))


def test_vmm05_kv_only_keeps_loader():
    imp = implied(run(KV, "--enable_manual_loader=false"))
    assert imp["VMM-05"].value == "default"
    rep = run(KV)
    assert rep.resolved.provenance("enable_manual_loader").kind == "default"
    assert "VMM-05" not in implied(run(KV, W, "--backend=llm"))


def test_vmm06_mentions_max_cache_size_only_when_set():
    f = next(f for f in run("--vmm_memory_reserve_bytes=1073741824", "--max_cache_size=2147483648").findings
             if f.id == "VMM-06")
    assert set(f.flags) == {"vmm_memory_reserve_bytes", "max_cache_size"}
    assert run("--max_cache_size=2147483648").findings == []


def test_w01_backend_explicit_inferred_and_not_checked(model_dir):
    assert "W-01" in errors(run(W, EL, "--backend=vlm"))
    assert "W-01" not in run(W, EL, "--backend=llm").rule_ids()
    rep = run(W, EL, model=model_dir("vlm"))
    f = next(f for f in rep.findings if f.id == "W-01")
    assert "inferred from the model" in f.message
    assert "W-01" not in run(W, EL, model=model_dir("dense")).rule_ids()
    assert "W-01" in run(W, EL).not_checked


def test_w04_hybrid_model(model_dir):
    assert "W-04" in errors(run(W, EL, model=model_dir("hybrid")))
    assert "W-04" not in run(W, EL, model=model_dir("dense")).rule_ids()
    assert "W-04" in run(W, EL, "--backend=llm").not_checked


def test_pc01_implied_and_pc02_hybrid(model_dir):
    assert implied(run(KV))["PC-01"].key == "prefix_cache"
    assert "PC-01" not in implied(run(KV, "--noenable_prefix_cache"))
    assert "PC-02" in implied(run(KV, model=model_dir("hybrid")))
    assert "PC-02" not in implied(run(KV, model=model_dir("dense")))
    assert "PC-02" in run(KV).not_checked


def test_hk01_and_hk06_implied_with_quota():
    imp = implied(run(KV, "--host_blocks_factor=2", "--max_cache_size=4294967296"))
    assert imp["HK-01"].value is True
    assert imp["HK-06"].value == 8 * 1024**3
    assert "HK-01" not in implied(run(KV, "--host_blocks_factor=1"))
    assert "HK-06" not in implied(run("--host_blocks_factor=2"))


@pytest.mark.parametrize("kind", ["vlm", "sliding", "hybrid"])
def test_hk05_model_kinds(model_dir, kind):
    rep = run(KV, "--host_blocks_factor=2", model=model_dir(kind))
    assert "HK-05" in errors(rep)


def test_hk05_nearest_and_explicit_vlm(model_dir):
    assert "HK-05" not in run(KV, "--host_blocks_factor=2", model=model_dir("dense")).rule_ids()
    assert "HK-05" not in run(KV, "--host_blocks_factor=0", model=model_dir("vlm")).rule_ids()
    assert "HK-05" in errors(run(KV, "--host_blocks_factor=2", "--backend=vlm"))
    assert "HK-05" in run(KV, "--host_blocks_factor=2").not_checked


def test_hk07_is_left_to_the_sizing_plan():
    # HK-07 needs the plan (tests/planner/test_checks.py); the rules only mark it as applying.
    from xllm_vmm.config.rules import SIZING_PENDING

    args = (KV, "--host_blocks_factor=4", "--max_cache_size=68719476736")
    assert run(*args).not_checked["HK-07"] == SIZING_PENDING
    assert "HK-07" not in run(KV, "--host_blocks_factor=4", "--noenable_prefix_cache").not_checked
    assert "HK-07" not in run("--host_blocks_factor=4").not_checked


def test_sd01_mtp_implied():
    mtp = ("--num_speculative_tokens=3", "--speculative_algorithm=MTP", "--draft_model=/m")
    assert implied(run(KV, *mtp))["SD-01"].value == "mapped_with_target"
    assert "SD-01" not in implied(run(*mtp))


def test_hy01_hybrid(model_dir):
    assert implied(run(KV, model=model_dir("hybrid")))["HY-01"].value == "resident"
    assert "HY-01" not in implied(run(KV, model=model_dir("dense")))
    assert "HY-01" not in implied(run(model=model_dir("hybrid")))


def test_el01_el07_implied():
    imp = implied(run(KV, EL, "--vmm_memory_reserve_bytes=1073741824"))
    assert imp["EL-01"].value == "elastic"
    assert imp["EL-07"].value == "free - execution_peak - 1073741824"
    assert "EL-01" not in implied(run(KV))
    assert "EL-07" not in implied(run(KV))


def test_el02_only_when_explicit_from_any_source(tmp_path):
    toml = tmp_path / "a.toml"
    toml.write_text("max_memory_utilization = 0.8\n")
    cfg = load([KV, EL], [toml])
    f = next(f for f in check(cfg).findings if f.id == "EL-02")
    assert f.sources["max_memory_utilization"].location() == f"{toml}:1:1"
    cfg = load([KV, EL], env={"XLLM_VMM_MAX_MEMORY_UTILIZATION": "0.5"})
    assert "EL-02" in check(cfg).rule_ids()


def test_el03_fixed_vmm_and_weight_only_elastic_use_the_ratio():
    assert "EL-03" in errors(run(KV, "--max_memory_utilization=1.2"))
    assert "EL-03" in errors(run(W, EL, "--backend=llm", "--max_memory_utilization=0"))


def test_el05_reserve_negative():
    assert "EL-05" in errors(run("--vmm_memory_reserve_bytes=-1"))


def test_el06_minimum_is_one_page_per_vmm_tensor(model_dir):
    # tiny dense model: 2 layers x (K, V) = 4 tensors x 2 MiB = 8 MiB
    rep = run(KV, "--max_cache_size=7340032", model=model_dir("dense"))
    f = next(f for f in rep.findings if f.id == "EL-06")
    assert "8MiB (8388608 bytes)" in f.message and "4 VMM tensors" in f.message
    assert "EL-06" not in run(KV, "--max_cache_size=8388608", model=model_dir("dense")).rule_ids()
    assert "EL-06" not in run(KV, "--max_cache_size=0", model=model_dir("dense")).rule_ids()
    assert "EL-06" in run(KV, "--max_cache_size=7340032").not_checked


def test_el06_shared_pool_minimum_includes_the_weights(model_dir):
    """VMM-02: with weight VMM on as well, max_cache_size is the quota of the pool KV and
    weights share, so its least is the weights (per worker) plus one page per KV tensor — the
    figure plan uses too."""
    from xllm_vmm.models import load_model_spec

    weights = load_model_spec(str(model_dir("dense"))).served_weight_bytes
    least = 8 * 1024**2 + weights
    shared = (KV, "--enable_vmm_weights=true")
    rep = run(*shared, f"--max_cache_size={least - 1}", model=model_dir("dense"))
    f = next(f for f in rep.findings if f.id == "EL-06")
    assert f"of weights per worker in the pool they share (VMM-02)" in f.message
    assert f"at least {least} " in f.hint
    assert "EL-06" not in run(*shared, f"--max_cache_size={least}",
                              model=model_dir("dense")).rule_ids()
    # KV VMM alone: the weights are outside the pool, 8 MiB is enough
    assert "EL-06" not in run(KV, "--max_cache_size=8388608", model=model_dir("dense")).rule_ids()


def test_el08_device_memory():
    args = (KV, EL, "--vmm_memory_reserve_bytes=85899345920")
    assert "EL-08" in warnings(run(*args, device_memory=64 * 1024**3))
    assert "EL-08" not in run(*args, device_memory=96 * 1024**3).rule_ids()
    assert "EL-08" in run(*args).not_checked


def test_unreadable_model_is_reported_not_guessed(tmp_path):
    rep = run(KV, "--max_cache_size=7340032", model=str(tmp_path / "missing"))
    assert "EL-06" in rep.not_checked and "could not be read" in rep.not_checked["EL-06"]
    model, reason = find_model(load([]))
    assert model is None and reason == "no --model given"


def test_every_rule_of_rules_md_is_in_the_catalogue_and_covered():
    spec = Path(__file__).resolve().parents[2] / "xllm_vmm"  # noqa: F841 (package root)
    here = Path(__file__).read_text()
    ids = set(RULES)
    assert len(ids) == 44
    runtime = {r for r, v in RULES.items() if v.kind == "runtime"}
    assert runtime == {"W-02", "W-06", "AD-01", "AD-02", "AD-03", "AD-04", "AD-05"}
    for rid in ids - runtime:
        assert re.search(rf'"{rid}"', here), f"{rid} has no test"


@pytest.mark.parametrize("devices, message", [
    ("gpu:0", "device 'gpu:0': 'gpu' is not a device kind (kinds: npu, cuda, cpu, mlu, ilu, "
              "musa, dcu); did you mean cuda?"),
    ("npu:0,cuda:0", "devices mix kinds (npu and cuda): one engine serves on devices of one kind"),
    ("npu:99999999999999999999", "device 'npu:99999999999999999999': index "
                                 "99999999999999999999 is out of range (0..1023)"),
])
def test_devices_of_unknown_or_mixed_kinds_or_absurd_index_are_type_errors(devices, message):
    rep = run(f"--devices={devices}")
    assert [f.id for f in rep.findings] == ["CFG-TYPE"]
    assert rep.findings[0].message == f"devices: {message} (command line)"


def test_tp_size_outside_dit_is_ignored_by_the_engine():
    rep = run("--tp_size", "4", "--devices=npu:0,npu:1")
    assert [(f.id, f.severity) for f in rep.findings] == [("CFG-IGNORED", "warning")]
    assert "tensor parallel over 2 worker(s)" in rep.findings[0].message
    # nearest non-triggers: tp_size equal to the world size / dp_size, or the DiT backend
    assert run("--tp_size", "2", "--devices=npu:0,npu:1").findings == []
    # (several devices per process of a 2-process launch: only what serve refuses, CFG-SERVE)
    assert [f.id for f in run("--tp_size", "4", "--nnodes=2",
                              "--devices=npu:0,npu:1").findings] == ["CFG-SERVE"]
    assert run("--tp_size", "4", "--backend=dit", "--devices=npu:0,npu:1").findings == []


@pytest.mark.parametrize("argv, message", [
    (["--nnodes=2", "--node_rank=2"], "node_rank=2 (command line) but nnodes=2"),
    (["--nnodes=6", "--dp_size=4"], "dp_size=4 does not divide the 6 workers"),
    (["--nnodes=6", "--ep_size=4"], "ep_size=4 does not divide the 6 workers"),
])
def test_worker_counts_the_engine_refuses(argv, message):
    rep = run(*argv)
    assert [(f.id, f.severity) for f in rep.findings] == [("CFG-CONFLICT", "error")]
    assert message in rep.findings[0].message


@pytest.mark.parametrize("argv, serve_refuses", [
    (["--nnodes=2", "--node_rank=1"], []), (["--nnodes=6", "--dp_size=3"], ["dp_size"]),
    (["--nnodes=8", "--ep_size=4"], []), (["--nnodes=8", "--ep_size=4", "--dp_size=2"],
                                          ["dp_size", "ep_size"]),
    (["--nnodes=3", "--devices=npu:0,npu:1", "--dp_size=6"], ["dp_size", "devices"]),
])
def test_worker_counts_the_engine_accepts(argv, serve_refuses):
    """The engine runs these; only the warnings of what xllm-vmm serve refuses (CFG-SERVE)."""
    found = run(*argv).findings
    assert [(f.id, f.severity) for f in found] == [("CFG-SERVE", "warning")] * len(serve_refuses)
    assert [list(f.flags)[0] for f in found] == serve_refuses


def test_workers_that_cannot_split_the_heads_are_a_conflict():
    rep = check_all(load(["--model=Qwen/Qwen3-8B", "--nnodes=3"]))
    assert [(f.id, f.severity) for f in rep.findings] == [("CFG-CONFLICT", "error")]
    assert "3 workers cannot split the 32 attention heads" in rep.findings[0].message
    # nearest non-triggers: 4 workers; 6 workers in 3 data-parallel groups of 2
    assert check_all(load(["--model=Qwen/Qwen3-8B", "--nnodes=4"])).findings == []
    assert [f.id for f in check_all(load(["--model=Qwen/Qwen3-8B", "--nnodes=6",
                                          "--dp_size=3"])).findings] == ["CFG-SERVE"]
