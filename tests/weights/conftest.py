"""Tiny safetensors checkpoints built in the test (no downloads), and the drivers the weights
tests run on: the host driver (memfd + mmap) and the ACL emulation."""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

import pytest

MiB = 1 << 20
PAGE = 2 * MiB


def random_tensors(dtype_name: str = "float32", *, hidden: int = 64, layers: int = 2,
                   vocab: int = 128, tied: bool = False, seed: int = 0) -> dict:
    """A decoder-shaped state dict (HF names) of random values."""
    import torch

    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype_name)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dt)

    sd = {"model.embed_tokens.weight": r(vocab, hidden), "model.norm.weight": r(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = r(hidden, hidden)
        sd[p + "self_attn.k_proj.weight"] = r(hidden // 2, hidden)
        sd[p + "self_attn.v_proj.weight"] = r(hidden // 2, hidden)
        sd[p + "self_attn.o_proj.weight"] = r(hidden, hidden)
        sd[p + "mlp.gate_proj.weight"] = r(2 * hidden, hidden)
        sd[p + "mlp.up_proj.weight"] = r(2 * hidden, hidden)
        sd[p + "mlp.down_proj.weight"] = r(hidden, 2 * hidden)
        sd[p + "input_layernorm.weight"] = r(hidden)
    if not tied:
        sd["lm_head.weight"] = r(vocab, hidden)
    return sd


def save_checkpoint(path: Path, tensors: dict, *, shards: int = 1, tied: bool = False) -> Path:
    """Writes ``tensors`` as safetensors: one ``model.safetensors``, or ``shards`` files plus
    ``model.safetensors.index.json``; and a config.json naming tie_word_embeddings."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"tie_word_embeddings": tied,
                                                  "model_type": "llama"}))
    names = list(tensors)
    if shards == 1:
        save_file({n: tensors[n].contiguous() for n in names}, str(path / "model.safetensors"))
        return path
    weight_map = {}
    per = -(-len(names) // shards)
    for s in range(shards):
        part = names[s * per:(s + 1) * per]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, str(path / fname))
        weight_map.update({n: fname for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
         "weight_map": weight_map}))
    return path


def file_bytes(model_dir: Path) -> dict[str, bytes]:
    """Each tensor's raw bytes as stored in the files (independent of the loader)."""
    from safetensors import safe_open

    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for n in h.keys():
                t = h.get_tensor(n)
                out[n] = t.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes()
    return out


def tensor_bytes(t) -> bytes:
    import torch

    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def checksums(weights) -> dict[str, str]:
    return {n: hashlib.sha256(tensor_bytes(t)).hexdigest() for n, t in weights.items()}


DRIVERS = ["host", "acl-emulation"]
#: the host driver on each huge-page backing: ``host`` is 4 KiB pages (the fresh machine),
#: ``host-thp`` shmem THP, ``host-hugetlb`` a hugetlb memfd (see :func:`backing_enabled`)
HOST_BACKINGS = ["host", "host-thp", "host-hugetlb"]
#: 2 MiB huge pages a hugetlb test adds to the machine's for its duration
TEST_HUGE_PAGES = 160


def open_test_driver(kind: str, device_memory: int | None = None):
    """``host`` (4 KiB pages, whatever the machine's huge-page settings: never ``auto``),
    ``host-thp``, ``host-hugetlb`` (inside :func:`backing_enabled`) or ``acl-emulation``."""
    from xllm_vmm.vmm import VmmUnavailable, open_driver

    try:
        if kind.startswith("host"):
            mode = kind.partition("-")[2] or "off"
            return open_driver("host", device_memory=device_memory, hugepages=mode)
        return open_driver("acl", library="emulation", device_memory=device_memory)
    except (VmmUnavailable, OSError) as e:  # pragma: no cover - native build missing
        pytest.skip(f"{kind} driver unavailable here: {e}")


def make_pool(driver, arena_bytes: int = 64 * MiB, **budget):
    from xllm_vmm.pool import BudgetConfig, VmmPool

    budget.setdefault("execution_peak_bytes", 0)
    return VmmPool(driver, BudgetConfig(**budget), arena_bytes)


@pytest.fixture(params=DRIVERS)
def driver_kind(request) -> str:
    return request.param


@contextlib.contextmanager
def backing_enabled(kind: str):
    """Makes the machine allow ``kind``'s huge-page backing for the ``with`` block:
    ``host-hugetlb`` raises ``vm.nr_hugepages`` by :data:`TEST_HUGE_PAGES`, ``host-thp`` sets
    shmem_enabled=advise when it is off — root only, under the lock shared by every process
    changing these settings (held for the whole block), restored after (:mod:`xllm_vmm.vmm.hugepages`); skipped with the
    reason where that cannot be done. Other kinds need nothing."""
    from xllm_vmm.vmm import hugepages as hp

    try:
        if kind == "host-hugetlb":
            with hp.extra_hugetlb_pages(TEST_HUGE_PAGES) as free:
                if free < TEST_HUGE_PAGES:
                    pytest.skip(f"the kernel found {free} free 2 MiB huge pages of the "
                                f"{TEST_HUGE_PAGES} asked for")
                yield
            return
        if kind == "host-thp":  # held under the lock even when on: nobody turns it off meanwhile
            try:
                setting = hp.machine_setting(
                    hp.SHMEM_ENABLED,
                    lambda old: old if old in hp.THP_SHMEM_ALLOWING else "advise")
                setting.__enter__()
            except hp.SettingUnavailable:
                if not hp.thp_shmem_allowed():
                    raise
                setting = None  # not root: as the machine is
            try:
                yield
            finally:
                if setting is not None:
                    setting.__exit__(None, None, None)
            return
    except hp.SettingUnavailable as exc:
        pytest.skip(f"{kind}: {exc}")
    yield


@pytest.fixture(params=HOST_BACKINGS + ["acl-emulation"])
def backing_kind(request):
    """Every driver the memory tests run on: the host driver on each huge-page backing (the
    backing enabled for the test) and the ACL emulation."""
    with backing_enabled(request.param):
        yield request.param


@pytest.fixture
def stack(driver_kind):
    """``factory(device_memory=None, arena_bytes=64 MiB, **budget) -> (driver, pool)``; closes
    what it opened (pools first, after every weights object made from them is closed)."""
    opened = []

    def factory(device_memory: int | None = 256 * MiB, arena_bytes: int = 64 * MiB, **budget):
        d = open_test_driver(driver_kind, device_memory)
        p = make_pool(d, arena_bytes, **budget)
        opened.append((d, p))
        return d, p

    factory.kind = driver_kind
    yield factory
    import gc

    gc.collect()
    for d, p in reversed(opened):
        p.close()
        d.close()
