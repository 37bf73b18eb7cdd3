#!/usr/bin/env bash
# One-shot device checks for a session that has an NVIDIA GPU (or an Ascend NPU with CANN):
# builds the native code, runs the driver conformance suite and the tensor-view tests against
# every driver that opens here (host, ACL emulation, CUDA, real ACL when XLLM_VMM_ACL_LIBRARY
# names libascendcl.so), then the map/copy benchmarks on the device. Exits non-zero on failure.
# Usage: bash tests/device/run_gpu_checks.sh   (about a minute; no network needed once installed)
set -euo pipefail
cd "$(dirname "$0")/../.."
python -m pip install --quiet --no-deps --no-build-isolation -e . 2>/dev/null \
  || python setup.py -q build_ext --inplace
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python - <<'PY'
from xllm_vmm.vmm import open_driver
d = open_driver("cuda")
print("cuda driver:", d, "granularity", d.granularity, "mem", d.mem_info())
d.close()
PY
python -m pytest -q -p no:cacheprovider tests/vmm -rs
python -m xllm_vmm.cli bench map --device cuda --pages 64 --rounds 3 --format json
python -m xllm_vmm.cli bench copy --device cuda --blocks 256 --format json
