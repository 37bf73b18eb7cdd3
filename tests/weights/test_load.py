"""load_weights: byte-exact against the safetensors files (single file and sharded with an
index; bf16 / fp16 / fp32; tied embeddings), plain CPU tensors and arena views, progress, the
shard hook, dtype conversion, and clear errors for bad checkpoints."""

from __future__ import annotations

import json
import struct

import pytest

torch = pytest.importorskip("torch")

from tests.weights.conftest import (PAGE, file_bytes, random_tensors, save_checkpoint,  # noqa: E402
                                    tensor_bytes)
from xllm_vmm.weights import (CheckpointError, ShardSpec, WeightVmmRequired,  # noqa: E402
                              load_weights)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("shards", [1, 3])
def test_plain_tensors_are_the_files_bytes(tmp_path, dtype, shards):
    model = save_checkpoint(tmp_path / "m", random_tensors(dtype), shards=shards)
    w = load_weights(model)
    expected = file_bytes(model)
    assert set(w) == set(expected)
    for name, raw in expected.items():
        assert w[name].dtype == getattr(torch, dtype)
        assert tensor_bytes(w[name]) == raw, name
    assert not w.vmm and w.device_bytes == 0
    assert w.nbytes == sum(len(b) for b in expected.values())


@pytest.mark.parametrize("shards", [1, 2])
def test_pool_tensors_view_the_weights_region(tmp_path, stack, shards):
    driver, pool = stack()
    model = save_checkpoint(tmp_path / "m", random_tensors("bfloat16"), shards=shards)
    w = load_weights(model, pool=pool)
    region = pool.region("weights")
    assert region.first_page + region.pages == pool.arena_pages  # the high end
    for name, raw in file_bytes(model).items():
        t = w[name]
        assert tensor_bytes(t) == raw, name
        assert region.base_va <= t.data_ptr() < region.base_va + region.nbytes
        assert t.data_ptr() % 512 == 0
    assert w.device_bytes == region.nbytes == pool.stats().per_tenant_mapped_bytes["weights"]
    assert pool.stats().per_tag_mapped_bytes["weights"] == region.nbytes
    w.close()
    assert pool.held_bytes == 0 and not pool.has_tenant("weights")


def test_tied_embeddings_have_no_lm_head(tmp_path):
    model = save_checkpoint(tmp_path / "m", random_tensors("float32", tied=True), tied=True)
    w = load_weights(model)
    assert "lm_head.weight" not in w and "model.embed_tokens.weight" in w
    assert w.tie_word_embeddings is True
    untied = save_checkpoint(tmp_path / "u", random_tensors("float32"))
    assert load_weights(untied).tie_word_embeddings is False


@pytest.mark.parametrize("with_pool", [False, True])
@pytest.mark.parametrize("keep_host_copy", [True, False])
def test_progress_is_monotonic_and_ends_at_total(tmp_path, stack, with_pool, keep_host_copy):
    model = save_checkpoint(tmp_path / "m", random_tensors("float32"), shards=2)
    calls = []
    pool = stack()[1] if with_pool else None
    w = load_weights(model, pool=pool, keep_host_copy=keep_host_copy,
                     progress=lambda done, total: calls.append((done, total)))
    total = w.nbytes
    assert calls[0] == (0, total) and calls[-1] == (total, total)
    assert all(t == total for _, t in calls)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    assert len(calls) >= len(w)  # one per tensor at least
    if with_pool:
        assert (w.host_copy_bytes > 0) == keep_host_copy
        w.close()


def test_keep_host_copy_false_streams_and_is_exact(tmp_path, stack, monkeypatch):
    """Without a host copy the load streams through a staging window; a small window forces
    several windows and a tensor bigger than it."""
    from xllm_vmm.weights import store

    monkeypatch.setattr(store, "COPY_CHUNK_BYTES", 8192)
    driver, pool = stack()
    model = save_checkpoint(tmp_path / "m", random_tensors("float32"))
    w = load_weights(model, pool=pool, keep_host_copy=False)
    assert w.host_copy_bytes == 0
    for name, raw in file_bytes(model).items():
        assert tensor_bytes(w[name]) == raw, name
    w.close()


def _tp_hook(rank: int, world: int):
    def hook(name, shape):
        if name.endswith(("q_proj.weight", "gate_proj.weight", "up_proj.weight")):
            return ShardSpec.split(0, shape[0], rank, world)  # column parallel
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            return ShardSpec.split(1, shape[1], rank, world)  # row parallel
        return None
    return hook


@pytest.mark.parametrize("with_pool", [False, True])
def test_shard_hook_loads_each_ranks_part(tmp_path, stack, with_pool):
    sd = random_tensors("bfloat16")
    model = save_checkpoint(tmp_path / "m", sd)
    pool = stack()[1] if with_pool else None
    parts = []
    for rank in range(2):
        w = load_weights(model, pool=pool, shard=_tp_hook(rank, 2))
        parts.append({n: t.clone() for n, t in w.items()})
        if with_pool:
            w.close()
    for name, full in sd.items():
        if name.endswith(("q_proj.weight", "gate_proj.weight", "up_proj.weight")):
            assert torch.equal(torch.cat([parts[0][name], parts[1][name]], 0), full)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            assert parts[0][name].shape[1] == full.shape[1] // 2
            assert torch.equal(torch.cat([parts[0][name], parts[1][name]], 1), full)
        else:
            assert torch.equal(parts[0][name], full) and torch.equal(parts[1][name], full)


def test_dtype_converts_floating_tensors_only(tmp_path, stack):
    sd = random_tensors("float32")
    sd["model.ids"] = torch.arange(10, dtype=torch.int64)
    model = save_checkpoint(tmp_path / "m", sd)
    for pool in (None, stack()[1]):
        w = load_weights(model, pool=pool, dtype=torch.bfloat16)
        assert w["model.ids"].dtype == torch.int64 and torch.equal(w["model.ids"], sd["model.ids"])
        for name in sd:
            if name != "model.ids":
                assert w[name].dtype == torch.bfloat16
                assert torch.equal(w[name], sd[name].to(torch.bfloat16))
        if pool is not None:
            w.close()
    with pytest.raises(ValueError, match="dtype=torch.int8"):
        load_weights(model, dtype=torch.int8)


def test_shard_hook_answers_are_checked(tmp_path):
    model = save_checkpoint(tmp_path / "m", random_tensors("float32"))
    with pytest.raises(CheckpointError, match="outside"):
        load_weights(model, shard=lambda n, s: ShardSpec(0, 0, s[0] + 1))
    with pytest.raises(CheckpointError, match="along dim 3"):
        load_weights(model, shard=lambda n, s: ShardSpec(3, 0, 1))
    with pytest.raises(CheckpointError, match="ShardSpec or None"):
        load_weights(model, shard=lambda n, s: (0, 1))
    with pytest.raises(ValueError, match="equal parts"):
        ShardSpec.split(0, 10, 0, 3)


def test_plain_weights_refuse_sleep_wakeup_fork_w02(tmp_path):
    w = load_weights(save_checkpoint(tmp_path / "m", random_tensors("float32")))
    for call in (lambda: w.sleep(1), w.wake_up, w.fork):
        with pytest.raises(WeightVmmRequired, match="enable_vmm_weights=true") as e:
            call()
        assert "W-02" in str(e.value)
    w.check_loaded()  # plain weights are always loaded


def test_bad_checkpoints_are_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="not a model directory"):
        load_weights(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_weights(tmp_path / "empty")
    model = save_checkpoint(tmp_path / "m", random_tensors("float32"), shards=2)
    index = json.loads((model / "model.safetensors.index.json").read_text())
    index["weight_map"]["ghost.weight"] = "model-00001-of-00002.safetensors"
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="not in it .first: 'ghost.weight'"):
        load_weights(model)
    index["weight_map"]["ghost.weight"] = "missing.safetensors"
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="'missing.safetensors', which is missing"):
        load_weights(model)
    bad = tmp_path / "bad"
    bad.mkdir()
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
    (bad / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    with pytest.raises(CheckpointError, match="do not hold"):
        load_weights(bad)
    (bad / "model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="shorter than its 8-byte header"):
        load_weights(bad)


def test_failed_load_leaves_nothing_in_the_pool(tmp_path, stack):
    """A pool too small for the weights: the load fails with the missing bytes and leaves no
    page, no host buffer and no region behind."""
    from xllm_vmm.weights import WeightsOutOfMemory

    sd = {"big.weight": torch.randn(3 * PAGE // 4)}  # 6 MiB of float32: 3 pages
    model = save_checkpoint(tmp_path / "m", sd)
    driver, pool = stack(device_memory=2 * PAGE)
    with pytest.raises(WeightsOutOfMemory, match="load failed: .* bytes missing") as e:
        load_weights(model, pool=pool)
    assert e.value.missing_bytes >= PAGE
    assert pool.held_bytes == 0 and not pool.has_tenant("weights")
    w = load_weights(model, pool=pool, dtype=torch.bfloat16)  # 3 MiB: 2 pages fit
    assert torch.equal(w["big.weight"], sd["big.weight"].to(torch.bfloat16))
    w.close()


def test_importing_the_package_imports_no_torch():
    import subprocess
    import sys

    code = ("import sys, xllm_vmm.weights, xllm_vmm.weights.sleep, xllm_vmm.weights.runtime_rules; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_region_bytes_is_what_the_load_takes(tmp_path, stack):
    from xllm_vmm.weights import region_bytes

    sd = random_tensors("bfloat16")
    sd["odd"] = torch.zeros(PAGE // 2 - 3, dtype=torch.bfloat16)  # pushes padding over a page
    model = save_checkpoint(tmp_path / "m", sd, shards=2)
    driver, pool = stack()
    want = region_bytes(model, page_bytes=pool.page_bytes)
    w = load_weights(model, pool=pool)
    assert want == w.device_bytes == pool.held_bytes
    assert want % PAGE == 0 and want >= w.nbytes
    as_fp32 = region_bytes(model, page_bytes=pool.page_bytes, dtype=torch.float32)
    assert as_fp32 > want  # twice the bytes once converted
    w.close()
    with pytest.raises(ValueError, match="page_bytes"):
        region_bytes(model, page_bytes=0)


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 5000), min_size=0, max_size=30),
       limit=st.integers(512, 8192))
def test_image_placement_and_windows(sizes, limit):
    """Tensors are placed in order at 512-byte aligned, disjoint offsets; the copy windows tile
    [0, nbytes) exactly, their tensors within the limit unless one tensor alone is larger."""
    from pathlib import Path

    from xllm_vmm.weights.checkpoint import Checkpoint, TensorEntry
    from xllm_vmm.weights.image import TENSOR_ALIGN, plan_image

    entries = tuple(TensorEntry(f"t{i}", "U8", (n,), Path("x"), 8, n) for i, n in enumerate(sizes))
    image = plan_image(Checkpoint(Path("."), entries, {}, {}))
    end = 0
    for p in image.placed:
        assert p.offset % TENSOR_ALIGN == 0 and p.offset >= end
        end = p.offset + p.nbytes
    assert image.nbytes == max(end, 1)
    windows = image.windows(limit)
    assert windows[0][0] == 0 and windows[-1][1] == image.nbytes
    for (lo, hi, ts), nxt in zip(windows, windows[1:] + [None]):
        if nxt is not None:
            assert hi == nxt[0]
        assert all(lo <= p.offset and p.offset + p.nbytes <= hi for p in ts)
        if not ts:  # no tensors at all: one empty window
            assert (lo, hi) == (0, image.nbytes) and not image.placed
            continue
        assert ts[-1].offset + ts[-1].nbytes - lo <= limit or len(ts) == 1
        assert hi - (ts[-1].offset + ts[-1].nbytes) < TENSOR_ALIGN or nxt is None
    assert [p for _, _, ts in windows for p in ts] == list(image.placed)


def test_image_places_each_layers_projections_back_to_back():
    """q/k/v (weights and biases) and gate/up of a layer are placed together in product order
    where the group's first tensor falls (names sort k, o, q, v in a checkpoint), the rest in
    checkpoint order; with 512-byte multiples the parts are adjacent (one view fuses them)."""
    from pathlib import Path

    from xllm_vmm.weights.checkpoint import Checkpoint, TensorEntry
    from xllm_vmm.weights.image import TENSOR_ALIGN, plan_image

    names = ["model.embed_tokens.weight"]
    for i in range(2):
        a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        names += [f"{m}.down_proj.weight", f"{m}.gate_proj.weight", f"{m}.up_proj.weight",
                  f"{a}.k_proj.bias", f"{a}.k_proj.weight", f"{a}.o_proj.weight",
                  f"{a}.q_proj.bias", f"{a}.q_proj.weight", f"{a}.v_proj.bias",
                  f"{a}.v_proj.weight"]
    names.append("model.layers.1.self_attn.q_norm.weight")
    entries = tuple(TensorEntry(n, "U8", (1024,), Path("x"), 8 + 1024 * i, 1024)
                    for i, n in enumerate(names))
    image = plan_image(Checkpoint(Path("."), entries, {}, {}))
    order = [p.name for p in image.placed]
    assert sorted(order) == sorted(names)
    a, m = "model.layers.0.self_attn", "model.layers.0.mlp"
    assert order[:11] == ["model.embed_tokens.weight", f"{m}.down_proj.weight",
                          f"{m}.gate_proj.weight", f"{m}.up_proj.weight",
                          f"{a}.q_proj.bias", f"{a}.k_proj.bias",
                          f"{a}.v_proj.bias", f"{a}.q_proj.weight", f"{a}.k_proj.weight",
                          f"{a}.v_proj.weight", f"{a}.o_proj.weight"]
    assert order[-1] == "model.layers.1.self_attn.q_norm.weight"
    at = {p.name: p for p in image.placed}
    for g in ("q_proj", "k_proj"):  # back to back: no padding between the parts
        nxt = {"q_proj": "k_proj", "k_proj": "v_proj"}[g]
        assert at[f"{a}.{g}.weight"].offset + 1024 == at[f"{a}.{nxt}.weight"].offset
    assert all(p.offset % TENSOR_ALIGN == 0 for p in image.placed)
    # an incomplete group (no v_proj) keeps checkpoint order
    part = tuple(e for e in entries if e.name != f"{a}.v_proj.weight")
    order = [p.name for p in plan_image(Checkpoint(Path("."), part, {}, {})).placed]
    assert order.index(f"{a}.k_proj.weight") < order.index(f"{a}.o_proj.weight") < order.index(
        f"{a}.q_proj.weight")


def test_a_simulated_pool_is_refused(tmp_path):
    from tests.weights.conftest import make_pool
    from xllm_vmm.vmm.sim import SimDriver

    model = save_checkpoint(tmp_path / "m", random_tensors("float32"))
    pool = make_pool(SimDriver(64 << 20))
    with pytest.raises(ValueError, match="no memory behind its addresses"):
        load_weights(model, pool=pool)
    assert not pool.has_tenant("weights")
