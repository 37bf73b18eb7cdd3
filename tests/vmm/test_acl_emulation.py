"""The ACL emulation (``libascendcl_emu.so``) enforces the real ACL constraints and codes, and
the acl driver turns them into typed errors with ``aclGetRecentErrMsg`` text."""

from __future__ import annotations

import ctypes as C
import threading

import pytest

from xllm_vmm.vmm import VmmOutOfMemory, open_driver
from xllm_vmm.vmm.acl import (
    ACL_HBM_MEM_HUGE,
    aclrtMemLocation,
    aclrtPhysicalMemProp,
    load_library,
    resolve_library,
)

MiB = 1024 * 1024
G = 2 * MiB


@pytest.fixture
def acl():
    lib = load_library(resolve_library("emulation"))
    rc = lib.aclInit(None)
    assert rc in (0, 100002)
    lib.aclGetRecentErrMsg()
    assert lib.aclrtSetDevice(0) == 0
    lib.xllmEmuSetDeviceMemory.argtypes = [C.c_int32, C.c_uint64]
    yield lib
    lib.xllmEmuSetDeviceMemory(0, 1 << 40)


def prop(mem_attr=ACL_HBM_MEM_HUGE, dev=0, loc_type=1, alloc_type=0):
    return aclrtPhysicalMemProp(handleType=0, allocationType=alloc_type, memAttr=mem_attr,
                                location=aclrtMemLocation(id=dev, type=loc_type), reserve=0)


def msg(lib) -> str:
    m = lib.aclGetRecentErrMsg()
    return m.decode() if m else ""


def test_repeat_init_is_100002_and_error_message_is_cleared_on_read(acl):
    assert acl.aclInit(None) == 100002
    assert "repeated initialization" in msg(acl)
    assert acl.aclGetRecentErrMsg() is None  # read once, then cleared


def test_granularity_is_2mib_for_hbm_huge_and_1gib_for_huge1g(acl):
    g = C.c_size_t()
    assert acl.aclrtMemGetAllocationGranularity(C.byref(prop()), 1, C.byref(g)) == 0
    assert g.value == 2 * MiB
    assert acl.aclrtMemGetAllocationGranularity(C.byref(prop(mem_attr=10)), 0, C.byref(g)) == 0
    assert g.value == 1 << 30
    assert acl.aclrtMemGetAllocationGranularity(C.byref(prop(mem_attr=99)), 0, C.byref(g)) == 107016


def test_physical_memory_constraints(acl):
    h = C.c_void_p()
    assert acl.aclrtMallocPhysical(C.byref(h), G + 4096, C.byref(prop()), 0) == 107000
    assert "multiple of 2097152" in msg(acl)
    assert acl.aclrtMallocPhysical(C.byref(h), G, C.byref(prop(alloc_type=1)), 0) == 107000  # CUDA's PINNED
    assert "PINNED (0)" in msg(acl)
    assert acl.aclrtMallocPhysical(C.byref(h), G, C.byref(prop(loc_type=0)), 0) == 107000
    assert acl.aclrtMallocPhysical(C.byref(h), G, C.byref(prop()), 1) == 107000  # flags must be 0
    assert acl.aclrtMallocPhysical(C.byref(h), G, C.byref(prop()), 0) == 0
    assert acl.aclrtFreePhysical(h) == 0
    assert acl.aclrtFreePhysical(h) == 107017  # freed twice


def test_map_rules_size_offset_unmap_by_start_release_when_unmapped(acl):
    va, h = C.c_void_p(), C.c_void_p()
    assert acl.aclrtReserveMemAddress(C.byref(va), 4 * G, 0, None, 0) == 0
    assert acl.aclrtReserveMemAddress(C.byref(C.c_void_p()), G, 4096, None, 0) == 107000  # alignment
    assert acl.aclrtMallocPhysical(C.byref(h), 2 * G, C.byref(prop()), 0) == 0
    assert acl.aclrtMapMem(va, G, 0, h, 0) == 107000  # size must equal the handle's
    assert "must equal the size" in msg(acl)
    assert acl.aclrtMapMem(va, 2 * G, G, h, 0) == 107000  # offset must be 0
    assert acl.aclrtMapMem(va.value + 4096, 2 * G, 0, h, 0) == 107008  # unaligned
    assert acl.aclrtMapMem(va, 2 * G, 0, h, 0) == 0
    assert acl.aclrtMapMem(va, 2 * G, 0, h, 0) == 107000  # already mapped
    assert "already mapped" in msg(acl)
    assert acl.aclrtUnmapMem(va.value + G) == 107000  # not the start of the mapping
    assert acl.aclrtReleaseMemAddress(va) == 107000  # still mapped
    assert "mapped page" in msg(acl)
    # free while mapped: released only when the last mapping goes
    assert acl.aclrtFreePhysical(h) == 0
    assert acl.aclrtUnmapMem(va) == 0
    assert acl.aclrtMapMem(va, 2 * G, 0, h, 0) == 107017  # the handle is gone now
    assert acl.aclrtReleaseMemAddress(va) == 0


def test_device_is_per_thread(acl):
    result = {}

    def worker():
        free, total = C.c_size_t(), C.c_size_t()
        result["before"] = acl.aclrtGetMemInfo(1, C.byref(free), C.byref(total))
        result["msg"] = msg(acl)
        result["set"] = acl.aclrtSetDevice(0)
        result["after"] = acl.aclrtGetMemInfo(1, C.byref(free), C.byref(total))

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert result == {"before": 107002, "msg": result["msg"], "set": 0, "after": 0}
    assert "aclrtSetDevice" in result["msg"]


def test_out_of_memory_is_207001_and_the_driver_raises_vmm_out_of_memory(acl):
    d = open_driver("acl", library="emulation")
    try:
        acl.xllmEmuSetDeviceMemory(0, 8 * MiB)
        assert d.mem_info().total == 8 * MiB
        hs = d.create_handles(4, G)
        with pytest.raises(VmmOutOfMemory) as err:
            d.create_handle(G)
        assert err.value.code == 207001
        assert "out of memory on device 0" in err.value.device_message
        for h in hs:
            d.free_handle(h)
        assert d.mem_info().free == 8 * MiB
    finally:
        acl.xllmEmuSetDeviceMemory(0, 1 << 40)
        d.close()


def test_copies_refuse_unmapped_device_memory(acl):
    va, h = C.c_void_p(), C.c_void_p()
    assert acl.aclrtReserveMemAddress(C.byref(va), G, 0, None, 0) == 0
    buf = C.create_string_buffer(64)
    assert acl.aclrtMemcpy(va, 64, buf, 64, 1) == 107000  # H2D to reserved, unmapped memory
    assert acl.aclrtMallocPhysical(C.byref(h), G, C.byref(prop()), 0) == 0
    assert acl.aclrtMapMem(va, G, 0, h, 0) == 0
    assert acl.aclrtMemcpy(va, 32, buf, 64, 1) == 107000  # count > destMax
    assert acl.aclrtMemcpy(va, 64, buf, 64, 1) == 0
    assert acl.aclrtUnmapMem(va) == 0
    assert acl.aclrtFreePhysical(h) == 0
    assert acl.aclrtReleaseMemAddress(va) == 0


def test_missing_acl_library_is_a_clear_unavailable_error(monkeypatch):
    from xllm_vmm.vmm import VmmUnavailable

    with pytest.raises(VmmUnavailable) as err:
        open_driver("npu", library="/nonexistent/libascendcl.so")
    assert "set_env.sh" in str(err.value) and "XLLM_VMM_ACL_LIBRARY" in str(err.value)


def test_emulated_device_larger_than_the_host_is_bounded_by_host_memory():
    """An emulated device configured larger than the host never offers more than the host can
    commit (available memory at aclInit less the driver's margin), so a caller sizing by
    mem_info().free gets a refusal code, not the kernel's OOM killer. Runs in a fresh process:
    the emulation reads its configuration once, at aclInit. Allocates nothing."""
    import json
    import os
    import subprocess
    import sys

    code = ("import json; from xllm_vmm.vmm import open_driver; "
            "from xllm_vmm.vmm.sysmem import meminfo; "
            "d = open_driver('acl', library='emulation'); m = d.mem_info(); "
            "print(json.dumps([m.free, m.total, meminfo()['MemAvailable']]))")
    env = dict(os.environ, XLLM_VMM_ACL_EMU_DEVICE_MEMORY=str(1 << 50))  # a 1 PiB "device"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    free, total, available = json.loads(out.stdout)
    assert total == 1 << 50
    assert 0 < free < available  # bounded by the host, less the margin


def _emu_process(code: str, **env: str):
    """Runs ``code`` in a fresh process (the emulation reads its configuration at aclInit);
    returns the JSON it prints."""
    import json
    import os
    import subprocess
    import sys

    full = dict(os.environ, **env)
    out = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


_OPEN = ("import json, os\nfrom xllm_vmm.vmm import open_driver\n"
         "try:\n    d = open_driver('acl', library='emulation')\n"
         "except Exception as e:\n    print(json.dumps([type(e).__name__, str(e)])); raise SystemExit\n")


@pytest.mark.parametrize("value,total", [("1GiB", 1 << 30), ("512MiB", 512 * MiB), ("2g", 2 << 30),
                                         ("64 K", 64 << 10), ("1048576", 1 << 20), ("3T", 3 << 40)])
def test_device_memory_accepts_sizes_with_suffixes(value, total):
    out = _emu_process(_OPEN + "print(json.dumps(d.mem_info().total))",
                       XLLM_VMM_ACL_EMU_DEVICE_MEMORY=value)
    assert out == total


@pytest.mark.parametrize("name,value", [("XLLM_VMM_ACL_EMU_DEVICE_MEMORY", "garbage"),
                                        ("XLLM_VMM_ACL_EMU_DEVICE_MEMORY", "1.5GiB"),
                                        ("XLLM_VMM_ACL_EMU_DEVICE_MEMORY", "0"),
                                        ("XLLM_VMM_ACL_EMU_DEVICE_MEMORY", "99999999999T"),
                                        ("XLLM_VMM_ACL_EMU_DEVICE_COUNT", "two"),
                                        ("XLLM_VMM_ACL_EMU_DEVICE_COUNT", "17")])
def test_bad_configuration_fails_aclinit_loudly(name, value):
    kind, text = _emu_process(_OPEN + "print(json.dumps(['opened', '']))", **{name: value})
    assert kind == "VmmInvalidArgument"
    assert text.startswith("aclInit failed with code 100000: EE100000: aclInit: "
                           f"{name}='{value}' is not a"), text


def _margin() -> int:
    import os

    phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGESIZE")
    return max(512 * MiB, phys // 32)


@pytest.mark.parametrize("files", [("memory.max", "memory.current"),
                                   ("memory.limit_in_bytes", "memory.usage_in_bytes")])
def test_host_bound_follows_the_cgroup_limit_and_counts_host_buffers(tmp_path, files):
    """A fake memory cgroup (v2 or v1 file names) whose usage reflects what the process commits:
    the emulation offers limit − usage − margin, counts aclrtMallocHost buffers (size + one page
    of header) and refuses beyond it with 207001 (VmmOutOfMemory). Allocates ~6 MiB."""
    usages = []
    for d in (tmp_path, tmp_path / "memory"):  # the cgroup root (v2 hosts) and the v1 memory tree
        d.mkdir(exist_ok=True)
        (d / files[0]).write_text(str(_margin() + 8 * MiB))
        (d / files[1]).write_text("0")
        usages.append(str(d / files[1]))
    code = _OPEN + f"""
from xllm_vmm.vmm import VmmOutOfMemory
out = []
def commit(n):
    for usage in {usages!r}:
        cur = int(open(usage).read()); open(usage, 'w').write(str(cur + n))
out.append(d.mem_info().free)
try:
    d.alloc_host(16 << 20); out.append('allocated')
except VmmOutOfMemory as e:
    out.append(str(e))
buf = d.alloc_host(2 << 20); commit((2 << 20) + 4096)
out.append(d.mem_info().free)
hs = [d.create_handle(2 << 20)]; commit(2 << 20)
hs.append(d.create_handle(2 << 20)); commit(2 << 20)
out.append(d.mem_info().free)
try:
    d.create_handle(2 << 20); out.append('created')
except VmmOutOfMemory as e:
    out.append(str(e))
print(json.dumps(out))
"""
    out = _emu_process(code, XLLM_VMM_ACL_EMU_CGROUP_ROOT=str(tmp_path))
    assert out[0] == 8 * MiB
    assert out[1].startswith("aclrtMallocHost failed with code 207001: EE207001: aclrtMallocHost: out of host "
                             f"memory for the emulation: {16 * MiB + 4096} bytes requested, {8 * MiB} can be "
                             "committed"), out[1]
    assert out[2] == 6 * MiB - 4096
    assert out[3] == 2 * MiB - 4096
    assert "aclrtMallocPhysical: out of host memory for the emulation: 2097152 bytes requested, " \
           f"{2 * MiB - 4096} can be committed" in out[4], out[4]
