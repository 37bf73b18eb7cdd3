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
