"""Light and deep sleep, wakeup: every tensor byte-identical after each cycle (checksums), the
states and their typed errors, idempotency, the running-request refusal, fixed pools."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.weights.conftest import (checksums, file_bytes, random_tensors,  # noqa: E402
                                    save_checkpoint, tensor_bytes)
from xllm_vmm.weights import (DEEP_SLEEP, LIGHT_SLEEP, WAKEUP, CheckpointChanged,  # noqa: E402
                              SleepRefused, WeightsNotLoaded, load_weights)


@pytest.fixture
def model(tmp_path):
    return save_checkpoint(tmp_path / "m", random_tensors("bfloat16", hidden=128), shards=2)


@pytest.mark.parametrize("keep_host_copy", [True, False])
def test_light_and_deep_cycles_keep_every_byte(model, stack, keep_host_copy):
    driver, pool = stack()
    w = load_weights(model, pool=pool, keep_host_copy=keep_host_copy)
    before = checksums(w)
    addresses = {n: t.data_ptr() for n, t in w.items()}
    region = w.device_bytes
    for level, source in ((1, "host_copy"), (2, "checkpoint"), (1, "host_copy"), (2, "checkpoint")):
        report = w.sleep(level)
        assert report.state == (LIGHT_SLEEP if level == 1 else DEEP_SLEEP) == w.state
        assert report.bytes_freed == region and pool.held_bytes == 0
        assert report.seconds >= 0
        if level == 2:
            assert w.host_copy_bytes == 0
        else:
            assert w.host_copy_bytes > 0  # light sleep keeps (or makes) a host copy
        with pytest.raises(WeightsNotLoaded, match=w.state):
            w.check_loaded()
        assert w.stats()["mapped_bytes"] == 0 and w.stats()["state"] == w.state
        wake = w.wake_up()
        assert (wake.source, wake.state, wake.bytes_mapped) == (source, WAKEUP, region)
        w.check_loaded()
        assert checksums(w) == before
        assert {n: t.data_ptr() for n, t in w.items()} == addresses  # same virtual addresses
        assert (w.host_copy_bytes > 0) == keep_host_copy
    for name, raw in file_bytes(model).items():
        assert tensor_bytes(w[name]) == raw
    w.close()


def test_sleep_and_wakeup_are_idempotent_and_deepen(model, stack):
    driver, pool = stack()
    w = load_weights(model, pool=pool)
    assert w.wake_up().source == "none"
    assert w.sleep(1).bytes_freed > 0
    again = w.sleep(1)
    assert (again.bytes_freed, again.host_bytes_freed, again.state) == (0, 0, LIGHT_SLEEP)
    deeper = w.sleep(2)
    assert deeper.state == DEEP_SLEEP and deeper.bytes_freed == 0
    assert deeper.host_bytes_freed > 0 and w.host_copy_bytes == 0
    assert w.sleep(1).state == DEEP_SLEEP  # a lighter sleep does not undo a deep one
    assert w.wake_up().source == "checkpoint"
    assert w.wake_up().source == "none"
    with pytest.raises(ValueError, match="sleep level must be 1"):
        w.sleep(3)
    w.close()
    with pytest.raises(WeightsNotLoaded, match="CLOSED"):
        w.check_loaded()
    w.close()  # idempotent


def test_sleep_refused_while_requests_run(model, stack):
    driver, pool = stack()
    w = load_weights(model, pool=pool)
    with pytest.raises(SleepRefused, match="3 requests are running") as e:
        w.sleep(1, busy=3)
    assert e.value.running == 3
    with pytest.raises(SleepRefused, match="1 request is running"):
        w.sleep(2, busy=lambda: 1)
    assert w.state == WAKEUP and pool.held_bytes == w.device_bytes
    with pytest.raises(ValueError, match="busy must be a count"):
        w.sleep(1, busy=-1)
    assert w.sleep(1, busy=lambda: 0).state == LIGHT_SLEEP
    w.close()


def test_deep_wakeup_refuses_a_changed_checkpoint(model, stack):
    driver, pool = stack()
    w = load_weights(model, pool=pool)
    w.sleep(2)
    shard = sorted(model.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes() + b"x")
    with pytest.raises(CheckpointChanged, match="changed since the weights were loaded"):
        w.wake_up()
    assert w.state == DEEP_SLEEP and pool.held_bytes == 0
    w.close()


def test_fixed_pool_sleep_frees_nothing_and_keeps_bytes(model, driver_kind):
    """A fixed pool (vmm_elastic=false) never returns pages: sleep reports 0 bytes freed, the
    instance still refuses compute while asleep, and wakeup restores the bytes."""
    from tests.weights.conftest import make_pool, open_test_driver

    from xllm_vmm.pool import BudgetMode

    d = open_test_driver(driver_kind, 64 << 20)
    pool = make_pool(d, 16 << 20, mode=BudgetMode.FIXED, max_memory_utilization=0.9)
    w = load_weights(model, pool=pool)
    before, held = checksums(w), pool.held_bytes
    r = w.sleep(1)
    assert r.bytes_freed == 0 and pool.held_bytes == held
    with pytest.raises(WeightsNotLoaded):
        w.check_loaded()
    w.wake_up()
    assert checksums(w) == before
    w.sleep(2)
    w.wake_up()
    assert checksums(w) == before
    w.close()
    assert pool.held_bytes == 0  # the region went back with the last instance
    del w
    pool.close()
    d.close()


def test_weight_only_vmm_pages_the_weights_of_a_physical_pool(model, driver_kind):
    """Weight-only VMM (VMM-03, W-03): the KV cache is the physical pool's resident tenant, the
    weights a paged tenant of the same pool: their sleep gives the memory back, the KV cache's
    resident allocation stays."""
    from tests.weights.conftest import make_pool, open_test_driver

    from xllm_vmm.pool import BudgetMode

    d = open_test_driver(driver_kind, 128 << 20)
    pool = make_pool(d, 32 << 20, mode=BudgetMode.PHYSICAL, max_memory_utilization=0.5)
    w = load_weights(model, pool=pool)
    kv = pool.add_tenant("kv", 8 << 20)
    assert pool.is_mapped(kv, 0)
    want = checksums(w)
    stats = pool.stats()
    assert stats.per_tenant_mapped_bytes == {"weights": w.device_bytes, "kv": 8 << 20}
    free = d.mem_info().free
    assert w.sleep(1).bytes_freed == w.device_bytes
    assert d.mem_info().free == free + w.device_bytes
    assert pool.stats().per_tenant_mapped_bytes == {"weights": 0, "kv": 8 << 20}
    w.wake_up()
    assert checksums(w) == want
    w.close()
    assert pool.held_bytes == 8 << 20
    w = None
    pool.close()
    d.close()


def test_sharded_and_converted_weights_come_back_from_a_deep_sleep(model, stack):
    """A deep wakeup re-reads the files through the same shard hook and dtype conversion."""
    from xllm_vmm.weights import ShardSpec

    def hook(name, shape):
        if name.endswith("o_proj.weight"):
            return ShardSpec.split(1, shape[1], 1, 2)  # a strided (dimension-1) part
        if name.endswith("q_proj.weight"):
            return ShardSpec.split(0, shape[0], 0, 2)
        return None

    driver, pool = stack()
    for keep in (True, False):
        w = load_weights(model, pool=pool, shard=hook, dtype=torch.float32, keep_host_copy=keep)
        want = checksums(w)
        assert w["model.layers.0.self_attn.o_proj.weight"].shape == (128, 64)
        w.sleep(2)
        assert w.wake_up().source == "checkpoint"
        assert checksums(w) == want
        w.sleep(1)
        w.wake_up()
        assert checksums(w) == want
        w.close()


def test_sleep_is_refused_while_a_step_uses_the_weights(model, stack):
    import threading

    driver, pool = stack()
    w = load_weights(model, pool=pool)
    inside, release = threading.Event(), threading.Event()
    out = []

    def step():
        with w.using():
            inside.set()
            release.wait(5)
            out.append(sum(float(t.float().sum()) for t in w.values()))  # pages still mapped

    t = threading.Thread(target=step)
    t.start()
    assert inside.wait(5)
    with pytest.raises(SleepRefused, match="1 forward step is running"):
        w.sleep(1)
    release.set()
    t.join(5)
    assert len(out) == 1 and w.state == WAKEUP
    w.sleep(1)
    with pytest.raises(WeightsNotLoaded):
        with w.using():
            pass
    w.close()
