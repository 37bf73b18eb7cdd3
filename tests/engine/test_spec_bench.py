"""``xllm-vmm bench spec`` smoke run: the test setup's target and a (briefly) distilled draft,
every documented field present and sane (speed itself is never asserted: the machine is
shared), greedy output identical with and without speculation; bad options exit 2."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from xllm_vmm.cli.app import app


def test_bench_spec_smoke(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    args = ["bench", "spec", "--num-speculative-tokens", "2", "--prompts", "2",
            "--new-tokens", "6", "--repeats", "2", "--distill-steps", "3", "--format", "json"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    for key in ("spec_speedup", "spec_speedup_min", "plain_tokens_per_s_min",
                "plain_tokens_per_s_median", "spec_tokens_per_s_min", "spec_tokens_per_s_median",
                "mean_accepted_length", "target_passes_ratio"):
        assert doc[key] > 0, key
    assert doc["spec_speedup_min"] <= doc["spec_speedup"]
    assert 0 <= doc["acceptance_rate"] <= 1
    assert 0 <= doc["acceptance_per_pos_2"] <= doc["acceptance_per_pos_1"] <= 1
    assert 1 <= doc["mean_accepted_length"] <= 3
    assert doc["greedy_identical"] is True
    assert doc["target_branch_scale"] == 0.01 and doc["target_layers"] == 8
    assert doc["num_speculative_tokens"] == 2
    assert doc["omp_wait_policy"] and doc["threads"] >= 1
    assert list(tmp_path.glob("xllm-vmm/bench-mtp-*/done.json"))  # built once, cached
    again = CliRunner().invoke(app, args)  # reuses the cached pair
    assert again.exit_code == 0, again.stderr


def test_bench_spec_bad_options_exit_2():
    r = CliRunner().invoke(app, ["bench", "spec", "--num-speculative-tokens", "0"])
    assert r.exit_code == 2 and "--num-speculative-tokens" in r.stderr
    r = CliRunner().invoke(app, ["bench", "spec", "--branch-scale", "0"])
    assert r.exit_code == 2 and "branch-scale" in r.stderr


def test_the_package_never_imports_the_test_suite():
    """``bench spec`` (and everything else) runs from an installed wheel, which has no
    ``tests`` package: no module of ``xllm_vmm`` imports one, even lazily inside a function."""
    import ast
    from pathlib import Path

    import xllm_vmm

    root = Path(xllm_vmm.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            found += [f"{path.relative_to(root)}: {n}" for n in names
                      if n == "tests" or n.startswith("tests.")]
    assert not found, found
