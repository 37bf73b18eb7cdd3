import subprocess
import sys

import xllm_vmm


def test_version_flag_prints_package_version():
    out = subprocess.run([sys.executable, "-m", "xllm_vmm.cli", "--version"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"xllm-vmm {xllm_vmm.__version__}"
