"""Shared test fixtures."""

import os

# The host driver's huge-page backing defaults to "auto", which takes hugetlb pages whenever
# enough are free: tests must not depend on what another program left in vm.nr_hugepages, so
# they see the fresh-machine backing (4 KiB pages). A test about a backing passes hugepages=
# or sets XLLM_VMM_HOST_HUGEPAGES itself (tests/vmm/test_hugepages.py).
os.environ.setdefault("XLLM_VMM_HOST_HUGEPAGES", "off")
