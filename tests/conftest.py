"""Shared test fixtures."""

import os

# The host driver's huge-page backing defaults to "auto", which takes hugetlb pages whenever
# enough are free: tests must not depend on what another program left in vm.nr_hugepages, so
# they see the fresh-machine backing (4 KiB pages). A test about a backing passes hugepages=
# or sets XLLM_VMM_HOST_HUGEPAGES itself (tests/vmm/test_hugepages.py).
os.environ.setdefault("XLLM_VMM_HOST_HUGEPAGES", "off")

# Without --model the engine fetches the default model with pip: a test that means to fetch
# unsets this (tests/models/test_default_model.py); every other start without a model gets the
# embedded demo model, so the suite never downloads by accident.
os.environ.setdefault("XLLM_VMM_DEFAULT_MODEL", "demo")
