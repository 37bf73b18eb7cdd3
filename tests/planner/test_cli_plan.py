"""``xllm-vmm plan`` end to end: exit codes, formats, config sources, clear errors."""

import json

from typer.testing import CliRunner

from xllm_vmm.cli.app import app

runner = CliRunner()


def run(*args):
    return runner.invoke(app, ["plan", *args], env={})


def test_json_output_qwen3_8b():
    r = run("--model=Qwen/Qwen3-8B", "--format", "json", "--execution-peak", "1GiB",
            "--host-memory", "256GiB")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["verdict"] == "fits" and d["mode"] == "physical"
    assert d["per_worker"][0]["physical_budget_bytes"] == 37_520_368_844


def test_flags_in_gflags_syntax_and_devices_count():
    r = run("--model", "qwen__qwen3-8b", "--enable_vmm_kvcache", "--nnodes", "2",
            "--format=json", "--host-memory=256GiB")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["workers"] == 2 and d["mode"] == "fixed_vmm"
    r = run("--model=Qwen/Qwen3-8B", "--devices=npu:0,npu:1,npu:2,npu:3", "--format=json",
            "--host-memory=256GiB")
    assert json.loads(r.stdout)["workers"] == 4


def test_toml_config_file_and_device_profile(tmp_path):
    cfg = tmp_path / "serve.toml"
    cfg.write_text('[model]\nmodel = "Qwen/Qwen3-32B"\n[vmm]\nenable_vmm_kvcache = true\n'
                   'vmm_elastic = true\n')
    r = run("--config", str(cfg), "--device", "h200", "--format", "toml",
            "--host-memory=256GiB")
    assert r.exit_code == 0, r.output
    assert 'mode = "elastic_vmm"' in r.stdout and 'name = "h200"' in r.stdout


def test_does_not_fit_exits_1_and_explains():
    r = run("--model=deepseek-ai/DeepSeek-V3", "--nnodes=8", "--explain",
            "--host-memory=256GiB")
    assert r.exit_code == 1
    assert "does not fit" in r.stdout and "use 16 workers (nnodes=16" in r.stdout
    assert "floor(total x max_memory_utilization) - weights - execution peak" in r.stdout


def test_config_rule_errors_are_reported_and_fail():
    r = run("--model=Qwen/Qwen3-8B", "--enable_vmm_kvcache", "--kv_cache_dtype=int8",
            "--format=json", "--host-memory=256GiB")
    assert r.exit_code == 1
    d = json.loads(r.stdout)
    assert d["verdict"] == "does_not_fit" and d["reasons"][0]["code"] == "CONFIG"
    assert "QK-01" in {f["id"] for f in d["config_findings"]}


def test_list_models():
    r = run("--list-models", "--format", "json")
    assert r.exit_code == 0
    models = {m["name"]: m for m in json.loads(r.stdout)}
    assert "Qwen/Qwen3-8B" in models and len(models) == 13
    # the checkpoint's stored weight dtype, not the activation dtype
    assert models["deepseek-ai/DeepSeek-V3"]["weight_dtype"] == "FP8"
    assert models["openai/gpt-oss-20b"]["weight_dtype"] == "MXFP4"
    assert models["Qwen/Qwen3-8B"]["weight_dtype"] == "bfloat16"


def test_list_models_table_is_not_cut_when_piped():
    r = run("--list-models")  # CliRunner's stdout is not a terminal, like `| cat`
    assert r.exit_code == 0 and "…" not in r.stdout
    rows = [line for line in r.stdout.splitlines() if "deepseek-ai/DeepSeek-V3.2-Exp" in line]
    assert [c.strip() for c in rows[0].split("│")[1:-1]] == [
        "deepseek-ai/DeepSeek-V3.2-Exp", "61", "671.9B", "FP8 (bfloat16 rest)", "163,840",
        "MLA, MTP x1, MoE 256"]


def test_bad_inputs_are_clear_errors(tmp_path):
    r = run("--model=Qwen/Qwen3-9B")
    assert r.exit_code == 2 and "did you mean Qwen/Qwen3-8B" in r.stderr
    assert "Traceback" not in r.output
    r = run("--model=Qwen/Qwen3-8B", "--device", "h300")
    assert r.exit_code == 2 and "unknown device profile 'h300'" in r.stderr
    r = run("--model=Qwen/Qwen3-8B", "--device-memory", "lots")
    assert r.exit_code == 2 and "--device-memory 'lots' is not a size" in r.stderr
    r = run("--model=Qwen/Qwen3-8B", "--device-memory", "0")
    assert r.exit_code == 2 and "must be positive" in r.stderr
    (tmp_path / "config.json").write_text("{not json")
    r = run(f"--model={tmp_path}")
    assert r.exit_code == 2 and "config.json is not valid JSON" in r.stderr
    r = run()
    assert r.exit_code == 2 and "no model given" in r.stderr
    r = run("--model=Qwen/Qwen3-8B", "--nnodes=3")
    assert r.exit_code == 2 and "3 workers cannot split" in r.stderr


def test_damaged_safetensors_shard_is_a_warning_and_the_estimate_is_used(tmp_path):
    from xllm_vmm.models import load_model_spec
    from xllm_vmm.models.catalogue import read_catalogue_config

    (tmp_path / "config.json").write_text(json.dumps(read_catalogue_config("Qwen/Qwen3-8B")))
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    r = run(f"--model={tmp_path}", "--format=json", "--host-memory=256GiB")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["verdict"] == "fits"
    assert d["per_worker"][0]["weights_bytes"] == \
        load_model_spec("Qwen/Qwen3-8B").estimated_weight_bytes
    weights = [x for x in d["reasons"] if x["code"] == "WEIGHTS"]
    assert len(weights) == 1 and weights[0]["severity"] == "warning"
    assert "safetensors file is shorter than its 8-byte header length" in weights[0]["message"]
    assert str(tmp_path / "model.safetensors") in weights[0]["message"]


def test_workers_that_cannot_split_the_heads_are_an_error_naming_valid_counts():
    valid = "valid tensor-parallel sizes for Qwen/Qwen3-8B: 1, 2, 4, 8, 16, 32"
    r = run("--model=Qwen/Qwen3-8B", "--workers", "3", "--format=json")
    assert r.exit_code == 2 and r.stdout == ""
    assert "3 workers cannot split the 32 attention heads of Qwen/Qwen3-8B: 3 workers come " \
           "from --workers; " + valid in r.stderr
    r = run("--model=Qwen/Qwen3-8B", "--nnodes=3")
    assert r.exit_code == 2 and "come from nnodes=3 (from command line) x devices=auto" in r.stderr
    r = run("--model=Qwen/Qwen3-8B", "--devices=npu:0,npu:1,npu:2")
    assert r.exit_code == 2 and "devices=npu:0,npu:1,npu:2 (from command line)" in r.stderr
    # dp_size groups: 6 workers in 2 groups of 3 cannot split the heads either
    r = run("--model=Qwen/Qwen3-8B", "--nnodes=6", "--dp_size=2")
    assert r.exit_code == 2 and "6 workers in groups of 3 (dp_size 2)" in r.stderr
    assert "unbounded" not in r.output


def test_impossible_inputs_are_refused():
    r = run("--model=Qwen/Qwen3-8B", "--devices=npu:0,npu:0")
    assert r.exit_code == 2
    assert "devices=npu:0,npu:0 (from command line): device 'npu:0' is listed twice" in r.stderr
    r = run("--model=Qwen/Qwen3-8B", "--device-memory", "99999999999999999999999999GiB")
    assert r.exit_code == 2 and "--device-memory" in r.stderr
    assert "is more than 1 PiB: no machine has that" in r.stderr
    r = run("--model=Qwen/Qwen3-8B", "--host-memory", "2PiB")
    assert r.exit_code == 2 and "--host-memory" in r.stderr


def test_el06_is_listed_once_and_the_elastic_range_says_the_least_pool_does_not_fit(tmp_path):
    from xllm_vmm.models.catalogue import read_catalogue_config

    (tmp_path / "config.json").write_text(json.dumps(read_catalogue_config("Qwen/Qwen3-8B")))
    args = ("--model", str(tmp_path), "--enable_vmm_kvcache", "--vmm_elastic",
            "--max_cache_size=1048576", "--device-memory", "64GiB", "--host-memory=256GiB")
    r = run(*args, "--format=json")
    assert r.exit_code == 1
    d = json.loads(r.stdout)
    assert [x["code"] for x in d["reasons"]] == ["CONFIG"]
    assert [f["id"] for f in d["config_findings"]] == ["EL-06"]
    assert d["config_findings"][0]["hint"] == ("set --max_cache_size to at least 150994944 "
                                               "(144MiB), or 0 for no quota")
    text = run(*args).stdout
    assert [line.split(" max_cache_size")[0] for line in text.splitlines()
            if "[EL-06]" in line] == ["error [EL-06] EL-06:"]
    assert "none (the least pool, 144.00" in text and ".. 0 B" not in text


def test_workers_are_the_engines_world_size_tp_size_is_dit_only():
    # the engine: W = nnodes x len(devices); tensor parallel W / dp_size; tp_size for DiT only
    r = run("--model=Qwen/Qwen3-8B", "--tp_size", "4", "--devices=npu:0,npu:1",
            "--host-memory=256GiB", "--format=json")
    d = json.loads(r.stdout)
    assert r.exit_code == 0 and d["workers"] == 2
    assert [f["id"] for f in d["config_findings"]] == ["CFG-IGNORED"]
    r = run("--model=Qwen/Qwen3-8B", "--nnodes=16", "--host-memory=256GiB", "--format=json")
    assert json.loads(r.stdout)["workers"] == 16
    r = run("--model=Qwen/Qwen3-8B", "--nnodes=2", "--devices=npu:0,npu:1",
            "--host-memory=256GiB", "--format=json")
    assert json.loads(r.stdout)["workers"] == 4
    one = run("--model=Qwen/Qwen3-8B", "--nnodes=4", "--host-memory=256GiB", "--format=json")
    dp = run("--model=Qwen/Qwen3-8B", "--nnodes=4", "--dp_size=2", "--host-memory=256GiB",
             "--format=json")
    w1, w2 = (json.loads(x.stdout)["per_worker"][0]["weights_bytes"] for x in (one, dp))
    assert w2 == 2 * w1 or abs(w2 - 2 * w1) <= 1  # dense weights split 4 ways, then 2 ways


def test_rule_errors_el03_el05_hk08_are_findings_exit_1():
    """A value a rule rejects and the planner cannot size with is a rule finding in the report
    (verdict does_not_fit, exit 1), not a bare usage error (exit 2)."""
    cases = [(["--max_memory_utilization=1.5"], "EL-03"),
             (["--max_memory_utilization=0"], "EL-03"),
             (["--max_memory_utilization=0", "--enable_vmm_kvcache=true"], "EL-03"),
             (["--vmm_memory_reserve_bytes=-1"], "EL-05"),
             (["--max_cache_size=-5"], "EL-05"),
             (["--host_blocks_factor=-1"], "HK-08")]
    for args, rule in cases:
        r = run("--model=Qwen/Qwen3-8B", *args, "--format=json", "--host-memory=256GiB")
        assert r.exit_code == 1, (args, r.output)
        d = json.loads(r.stdout)
        assert d["verdict"] == "does_not_fit" and d["per_worker"] == [] and d["totals"] is None
        assert [x["code"] for x in d["reasons"]] == ["CONFIG"]
        assert d["reasons"][0]["message"] == f"the configuration has 1 error(s): {rule}"
        assert [f["id"] for f in d["config_findings"]] == [rule]
    r = run("--model=Qwen/Qwen3-8B", "--vmm_memory_reserve_bytes=-1", "--host-memory=256GiB")
    assert r.exit_code == 1 and "not sized (fix the errors below)" in r.stdout
    assert "[EL-05] EL-05: vmm_memory_reserve_bytes=-1 (command line) is negative" in r.stdout


def test_sizes_take_pib_and_pb_up_to_the_1_pib_cap():
    r = run("--model=Qwen/Qwen3-8B", "--host-memory", "1PiB", "--format=json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["host_memory_bytes"] == 1 << 50
    r = run("--model=Qwen/Qwen3-8B", "--device-memory", "0.5PiB", "--format=json",
            "--host-memory=1PB")
    d = json.loads(r.stdout)
    assert d["device"]["total_bytes"] == 1 << 49 and d["host_memory_bytes"] == 10**15
    r = run("--model=Qwen/Qwen3-8B", "--host-memory", "2PiB")
    assert r.exit_code == 2 and "--host-memory 2,251,799,813,685,248 bytes is more than 1 PiB" \
        in r.stderr


def test_config_sizes_take_pib():
    from xllm_vmm.cli.check_config import run as check_config
    from xllm_vmm.config.values import parse_size

    assert parse_size("1PiB") == parse_size("1P") == 1 << 50 and parse_size("2PB") == 2 * 10**15
    assert check_config(["--model=Qwen/Qwen3-8B", "--host-memory", "1PiB"]) == 0
    assert check_config(["--model=Qwen/Qwen3-8B", "--host-memory", "2PiB"]) == 2


def test_devices_error_hint_fits_the_error():
    r = run("--model=Qwen/Qwen3-8B", "--devices", "gpu:0")
    assert r.exit_code == 2
    assert r.stderr.strip().endswith("(kinds: npu, cuda, cpu, mlu, ilu, musa, dcu); did you mean "
                                     "cuda?")
    r = run("--model=Qwen/Qwen3-8B", "--devices", "npu:0,npu:0")
    assert r.stderr.strip().endswith("listed twice: each device serves one worker: list each "
                                     "device once, e.g. npu:0,npu:1")
    r = run("--model=Qwen/Qwen3-8B", "--devices", "npu:0,cuda:1")
    assert "list each device once" not in r.stderr
    assert r.stderr.strip().endswith("list devices of one kind as KIND:INDEX, comma-separated, "
                                     "e.g. npu:0,npu:1")


def test_suggested_workers_keep_the_data_parallel_groups_equal():
    r = run("--model=deepseek-ai/DeepSeek-V3", "--nnodes=4", "--dp_size=2", "--format=json",
            "--host-memory=1TiB")
    d = json.loads(r.stdout)
    assert r.exit_code == 1 and d["suggested_workers"] % 2 == 0
    assert d["suggested_workers"] == 32  # 16 per group, as 16 workers without dp
    one = json.loads(run("--model=deepseek-ai/DeepSeek-V3", "--nnodes=4", "--format=json",
                         "--host-memory=1TiB").stdout)
    assert one["suggested_workers"] == 16


def test_dp_size_that_does_not_divide_the_workers_is_a_finding_exit_1():
    r = run("--model=Qwen/Qwen3-8B", "--nnodes=6", "--dp_size=4", "--format=json",
            "--host-memory=1TiB")
    d = json.loads(r.stdout)
    assert r.exit_code == 1 and d["verdict"] == "does_not_fit" and d["per_worker"] == []
    assert "CFG-CONFLICT" in {f["id"] for f in d["config_findings"]}
    assert run("--model=Qwen/Qwen3-8B", "--nnodes=6", "--dp_size=3", "--format=json",
               "--host-memory=1TiB").exit_code == 0


def _quantized(tmp_path, quant):
    from xllm_vmm.models.catalogue import read_catalogue_config

    cfg = dict(read_catalogue_config("Qwen/Qwen3-8B"), quantization_config=quant)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = run(f"--model={tmp_path}", "--format=json", "--host-memory=256GiB")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    return d["per_worker"][0]["weights_bytes"], [x for x in d["reasons"] if x["code"] == "WEIGHTS"]


def test_gptq_without_bits_is_sized_at_its_default_width_with_a_warning(tmp_path):
    from xllm_vmm.models import load_model_spec

    plain = load_model_spec("Qwen/Qwen3-8B").estimated_weight_bytes
    nobits, warned = _quantized(tmp_path, {"quant_method": "gptq"})
    four, quiet = _quantized(tmp_path, {"quant_method": "gptq", "bits": 4})
    assert nobits == four < plain / 2  # not sized as unquantized
    assert quiet == [] and len(warned) == 1 and warned[0]["severity"] == "warning"
    assert "no bits: 4 bits per weight assumed" in warned[0]["message"]


def test_an_unknown_method_without_bits_warns_that_it_is_sized_unquantized(tmp_path):
    from xllm_vmm.models import load_model_spec

    plain = load_model_spec("Qwen/Qwen3-8B").estimated_weight_bytes
    size, warned = _quantized(tmp_path, {"quant_method": "somequant"})
    assert size == plain and len(warned) == 1
    assert "sized unquantized" in warned[0]["message"]
