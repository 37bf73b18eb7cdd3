"""SleepController: weights + the real KVCacheManager in one pool (VMM-02) sleep and wake
together; a tenant that cannot sleep leaves everything awake; a failed wakeup leaves everything
asleep; W-02 without weight VMM; the W-02 / W-06 sentences match the rule catalogue."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

from tests.kvcache.conftest import toy_layout  # noqa: E402
from tests.weights.conftest import (PAGE, checksums, make_pool, open_test_driver,  # noqa: E402
                                    random_tensors, save_checkpoint)
from xllm_vmm.weights import (LIGHT_SLEEP, WAKEUP, ResidentPoolRequired,  # noqa: E402
                              SleepController, SleepRefused, WakeupOutOfMemory,
                              WeightVmmRequired, load_weights, require_resident_pool,
                              require_weight_vmm, wait_idle)

BS = 16


@pytest.fixture
def instance(tmp_path, driver_kind):
    from xllm_vmm.kvcache import build_kv_cache_manager

    model = save_checkpoint(tmp_path / "m", random_tensors("float32", hidden=64))
    d = open_test_driver(driver_kind, 64 << 20)
    pool = make_pool(d, 64 * PAGE)
    weights = load_weights(model, pool=pool)
    kv = build_kv_cache_manager(pool, toy_layout(layers=1, blocks_per_page=4, block_size=BS),
                                enable_prefix_cache=True, max_tokens=8 * 4 * BS, compact=False)
    yield d, pool, weights, kv
    kv.close()
    weights.close()
    weights = None
    pool.close()
    d.close()


def _fill_kv(kv, rid="a", blocks=3):
    tokens = list(range(blocks * BS + 1))
    hit = kv.lookup(rid, tokens)
    assert kv.allocate(rid, len(tokens) - hit.num_tokens, hit=hit) is not None
    kv.commit(rid, len(tokens), tokens)


def test_weights_and_kv_sleep_and_wake_together(instance):
    d, pool, weights, kv = instance
    ctl = SleepController(weights, [kv])
    want = checksums(weights)
    _fill_kv(kv)
    kv.free("a")  # cached prefix blocks stay mapped
    kv_bytes = pool.stats().per_tenant_mapped_bytes["kv"]
    assert kv_bytes > 0
    report = ctl.sleep(1, busy=0)
    assert report.bytes_freed == kv_bytes + weights.device_bytes
    assert report.tenants_bytes_freed == kv_bytes
    assert pool.held_bytes == 0 and ctl.is_sleeping() and kv.is_sleeping()
    deeper = ctl.sleep(2)
    assert deeper.tenants_bytes_freed == 0 and deeper.host_bytes_freed > 0
    wake = ctl.wake_up()
    assert wake.state == WAKEUP and wake.source == "checkpoint"
    assert not kv.is_sleeping() and checksums(weights) == want
    _fill_kv(kv, "b")  # the KV cache maps again
    kv.free("b")


def test_a_tenant_that_cannot_sleep_leaves_everything_awake(instance):
    d, pool, weights, kv = instance
    _fill_kv(kv)  # request "a" still holds blocks
    held = pool.held_bytes

    class Sleeper:
        def __init__(self):
            self.calls = []

        def sleep(self):
            self.calls.append("sleep")
            return 0

        def wake_up(self):
            self.calls.append("wake")

    first = Sleeper()
    ctl = SleepController(weights, [first, kv])
    with pytest.raises(Exception, match="still hold KV blocks"):
        ctl.sleep(1)
    assert first.calls == ["sleep", "wake"]  # woken again
    assert weights.state == WAKEUP and pool.held_bytes == held
    with pytest.raises(SleepRefused, match="2 requests are running"):
        ctl.sleep(1, busy=lambda: 2)
    with pytest.raises(TypeError, match="not sleepable"):
        SleepController(weights, [object()])
    kv.free("a")


def test_failed_wakeup_leaves_every_tenant_asleep(instance):
    d, pool, weights, kv = instance
    ctl = SleepController(weights, [kv])
    ctl.sleep(1)
    hog = pool.add_tenant("hog", 40 * PAGE)
    pages = pool.mappable_pages(hog)
    assert pool.map_pages(hog, list(range(pages)))
    with pytest.raises(WakeupOutOfMemory):
        ctl.wake_up()
    assert weights.state == LIGHT_SLEEP and kv.is_sleeping()
    pool.remove_tenant("hog")
    ctl.wake_up()
    assert not ctl.is_sleeping()


def test_w02_without_weight_vmm(tmp_path):
    plain = load_weights(save_checkpoint(tmp_path / "m", random_tensors("float32")))
    for ctl in (SleepController(None), SleepController(plain)):
        with pytest.raises(WeightVmmRequired, match="W-02: sleep refused"):
            ctl.sleep(1)
        with pytest.raises(WeightVmmRequired, match="W-02: wakeup refused"):
            ctl.wake_up()
    with pytest.raises(WeightVmmRequired, match="W-02: fork refused"):
        require_weight_vmm(None, "fork")


def test_w06_remote_transfer_needs_a_resident_pool():
    from xllm_vmm.pool import BudgetMode
    from xllm_vmm.vmm.sim import SimDriver

    elastic = make_pool(SimDriver(64 << 20), 8 * PAGE)
    with pytest.raises(ResidentPoolRequired, match="W-06.*vmm_elastic=true"):
        require_resident_pool(elastic)
    fixed = make_pool(SimDriver(64 << 20), 8 * PAGE, mode=BudgetMode.FIXED)
    require_resident_pool(fixed)
    require_resident_pool(None)  # the physical (non-VMM) KV cache


def test_rule_sentences_match_the_catalogue():
    """W-02 / W-06 messages quote the same specification sentences as config.rules."""
    from xllm_vmm.config.rules import RULES
    from xllm_vmm.weights.errors import W02_SENTENCE, W06_SENTENCE

    assert W02_SENTENCE.rstrip(".") in RULES["W-02"].source
    assert W06_SENTENCE in RULES["W-06"].source
    assert "enable_vmm_weights" in str(WeightVmmRequired("sleep"))


def test_wait_idle_drains_or_times_out():
    running = [2]
    threading.Timer(0.05, lambda: running.__setitem__(0, 0)).start()
    wait_idle(lambda: running[0], timeout=5)
    with pytest.raises(SleepRefused, match="1 request is running"):
        wait_idle(lambda: 1, timeout=0.02)
