#!/usr/bin/env bash
# Installs xllm-vmm with its test dependencies (CPU build of torch, pinned) and runs the tests.
# This is the README's test command; .ci/run calls it.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check torch==2.13.0
python -m pip install --quiet --disable-pip-version-check -e '.[cpu,server,test]'
python -m pytest -q -n 2 "$@"
