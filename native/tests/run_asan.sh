#!/usr/bin/env bash
# Builds the native tests with AddressSanitizer (+UBSan) and runs them; leak detection on.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${TMPDIR:-/tmp}/xllm-vmm-native-asan
gcc -std=gnu11 -g -O1 -fsanitize=address,undefined -fno-omit-frame-pointer -Wall -Wno-format-truncation \
    -o "$out" tests/test_native.c hostvmm.c acl_emu.c -lpthread
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1 "$out"
