import subprocess
import sys

import xllm_vmm


def test_version_flag_prints_package_version():
    out = subprocess.run([sys.executable, "-m", "xllm_vmm.cli", "--version"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"xllm-vmm {xllm_vmm.__version__}"


def test_root_help_lists_commands():
    out = subprocess.run([sys.executable, "-m", "xllm_vmm.cli", "--help"],
                         capture_output=True, text=True, check=True)
    for cmd in ("check-config", "flags", "schema"):
        assert cmd in out.stdout


def test_unknown_command_is_a_usage_error():
    out = subprocess.run([sys.executable, "-m", "xllm_vmm.cli", "no-such-command"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr


import pytest  # noqa: E402


@pytest.mark.parametrize("argv", [
    ["flags", "--format=json"],
    ["schema"],
    ["plan", "--model=Qwen/Qwen3-8B", "--enable_vmm_kvcache", "--host_blocks_factor=2",
     "--format=json"],  # host memory read from this host (xllm_vmm.vmm.sysmem)
    ["plan", "--list-models"],
    ["check-config", "--model=Qwen/Qwen3-8B", "--enable_vmm_kvcache", "--host_blocks_factor=2",
     "--device-memory=64GiB", "--host-memory=100GiB", "-f", "json", "--no-env"],
], ids=["flags", "schema", "plan", "plan-list-models", "check-config-host-tier"])
def test_commands_do_not_import_torch(argv):
    code = ("import sys\n"
            f"sys.argv = ['xllm-vmm', *{argv!r}]\n"
            "from xllm_vmm.cli import main\n"
            "try:\n    main()\nexcept SystemExit as e:\n"
            "    sys.stderr.write(f'EXIT={e.code} TORCH={\"torch\" in sys.modules}')\n    raise\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.stderr.strip().endswith("TORCH=False"), p.stderr[-2000:]
    assert "EXIT=0" in p.stderr or "EXIT=None" in p.stderr


def test_flags_search_without_match_says_so_and_exits_1():
    out = subprocess.run([sys.executable, "-m", "xllm_vmm.cli", "flags", "--search", "zzzz"],
                         capture_output=True, text=True)
    assert out.returncode == 1 and out.stdout == ""
    assert "no flag has 'zzzz' in its name or help" in out.stderr


_OUTPUT_ARGV = {
    "check-config": ["check-config", "--format", "json", "--model=/m", "--enable_vmm_kvcache"],
    "flags": ["flags", "--format=json"],
    "plan-list-models": ["plan", "--list-models"],
}


@pytest.mark.parametrize("argv", _OUTPUT_ARGV.values(), ids=_OUTPUT_ARGV.keys())
def test_a_closed_pipe_ends_quietly_with_exit_1(argv):
    # `xllm-vmm ... | head -1`: the reader is gone before the command writes.
    import os

    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([sys.executable, "-m", "xllm_vmm.cli", *argv], stdout=w,
                           stderr=subprocess.PIPE, text=True)
    finally:
        os.close(w)
    assert p.returncode == 1 and p.stderr == ""


@pytest.mark.skipif(not __import__("os").path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("argv", _OUTPUT_ARGV.values(), ids=_OUTPUT_ARGV.keys())
def test_a_full_output_is_one_line_and_exit_2(argv):
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-m", "xllm_vmm.cli", *argv], stdout=full,
                           stderr=subprocess.PIPE, text=True)
    assert p.returncode == 2
    assert p.stderr == "error: cannot write the output: No space left on device\n"


@pytest.mark.parametrize("argv", [
    ["check-config", "--cmd", "xllm --port=1 --model=Qwen/Qwen3-8B --enable_vmm_kvcache"],
    ["check-config", "-f", "json", "tests/config/data/official/multi_machine_1.sh"],
], ids=["text", "json-script"])
def test_check_config_start_up_imports_little(argv):
    """check-config starts within a few times `python -c pass` (at most 4x). Measured as
    import work, not wall-clock time: the project's own modules it imports stay few, the only
    library beyond the standard one is rich (its text output), and none of the heavy ones
    (typer/click, pydantic, numpy, torch, safetensors, httpx). The count is of the project's
    modules, not of all: how many modules rich and the standard library split into differs
    between their versions (another machine's interpreter), not with this code."""
    code = ("import sys\nbase = set(sys.modules)\n"
            f"sys.argv = ['xllm-vmm', *{argv!r}, '--no-env']\n"
            "from xllm_vmm.cli import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "new = sorted(set(sys.modules) - base)\n"
            "sys.stderr.write('MODULES=' + ','.join(new))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=__import__("os").path.dirname(__import__("os").path.dirname(
                           __file__)))
    new = p.stderr.rsplit("MODULES=", 1)[1].split(",")
    heavy = {m.split(".")[0] for m in new} & {"typer", "click", "pydantic", "numpy", "torch",
                                              "safetensors", "httpx", "tomli_w", "hypothesis"}
    assert not heavy, heavy
    ours = [m for m in new if m.split(".")[0] == "xllm_vmm"]
    assert len(ours) <= 40, ours
    others = {m.split(".")[0] for m in new} - set(sys.stdlib_module_names) - {"xllm_vmm", "rich"}
    assert not others, others


def test_bench_tables_show_units_targets_and_plain_numbers():
    import io

    from xllm_vmm.cli import bench

    assert bench.plain(1.976e6) == "1,976,000" and bench.plain(0.000123456) == "0.0001235"
    assert bench.plain(12345) == "12,345" and bench.plain(2.0) == "2" and "e" not in \
        bench.plain(1e-12)
    assert bench.unit_of("batched_us_per_page") == "µs/page"
    assert bench.unit_of("copy_vs_memcpy_ratio") == "×" and bench.unit_of("total_bytes") == "bytes"
    assert bench.target_text("copy_vs_memcpy_ratio", 0.79) == ("≥ 0.8", "no")
    assert bench.target_text("copy_vs_memcpy_ratio", 0.8) == ("≥ 0.8", "yes")
    assert bench.target_text("total_bytes", 5) == ("", "")
    buf = io.StringIO()
    import rich.console

    real = rich.console.Console
    rich.console.Console = lambda *a, **k: real(file=buf, width=200)  # type: ignore[misc]
    try:
        bench.emit("t", {"copy_vs_memcpy_ratio": 1.05, "memcpy_gbps": 1976000.0,
                         "data_verified": True}, bench.OutputFormat.table)
    finally:
        rich.console.Console = real
    out = buf.getvalue()
    assert "1,976,000" in out and "e+06" not in out and "GB/s" in out
    row = next(line for line in out.splitlines() if "copy_vs_memcpy_ratio" in line)
    assert "1.05" in row and "×" in row and "≥ 0.8" in row and "yes" in row
