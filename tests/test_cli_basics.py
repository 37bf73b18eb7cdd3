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
], ids=["flags", "schema", "plan", "plan-list-models"])
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
