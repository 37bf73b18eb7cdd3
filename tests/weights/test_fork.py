"""Fork: an instance over the same physical pages (no byte mapped or copied, measured);
sleeping one instance never releases pages another awake instance uses (reference counts);
another checkpoint loads into the same pool within the shared budget."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.weights.conftest import (PAGE, checksums, make_pool, open_test_driver,  # noqa: E402
                                    random_tensors, save_checkpoint)
from xllm_vmm.weights import (DEEP_SLEEP, LIGHT_SLEEP, WAKEUP, WeightsNotLoaded,  # noqa: E402
                              WeightsOutOfMemory, load_weights)


def tiny_forward(w, x):
    """A two-layer matmul "model" straight over the weight tensors (no copies)."""
    w.check_loaded()
    h = x @ w["model.layers.0.mlp.up_proj.weight"].T
    h = torch.relu(h) @ w["model.layers.0.mlp.down_proj.weight"].T
    return h @ w["lm_head.weight"].T


@pytest.fixture
def model(tmp_path):
    return save_checkpoint(tmp_path / "m", random_tensors("float32", hidden=64), shards=2)


def _rss_shmem() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssShmem in /proc/self/status")


def test_fork_adds_no_weight_bytes(model, stack):
    driver, pool = stack()
    parent = load_weights(model, pool=pool)
    held, free = pool.held_bytes, driver.mem_info().free
    host = parent.host_copy_bytes
    shmem = _rss_shmem() if stack.kind == "host" else None
    child = parent.fork()
    assert child.shares_pages_with(parent) and child.state == WAKEUP
    assert pool.held_bytes == held and driver.mem_info().free == free
    assert child.host_copy_bytes == host
    if shmem is not None:
        assert _rss_shmem() == shmem
    for name in parent:
        assert child[name].data_ptr() == parent[name].data_ptr()
    s = child.stats()
    assert s["instances"] == 2 and s["mapped_bytes"] == s["device_bytes"] == held
    assert s["state"] == "WAKEUP" and s["tenant"] == "weights" and s["tensors"] == len(parent)
    child.close()
    assert parent.stats()["instances"] == 1
    parent.close()
    assert pool.held_bytes == 0


def test_sleeping_the_parent_leaves_the_forks_outputs_unchanged(model, stack):
    driver, pool = stack()
    parent = load_weights(model, pool=pool)
    child = parent.fork()
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    expected = tiny_forward(child, x)
    for level in (1, 2):
        report = parent.sleep(level)
        assert report.bytes_freed == 0  # the awake fork still uses the pages
        with pytest.raises(WeightsNotLoaded):
            tiny_forward(parent, x)
        assert torch.equal(tiny_forward(child, x), expected)
        assert parent.wake_up().source == "shared"
        assert torch.equal(tiny_forward(parent, x), expected)
    # the last awake instance going to sleep releases the pages; both come back exact
    parent.sleep(1)
    assert child.sleep(1).bytes_freed == parent.device_bytes and pool.held_bytes == 0
    assert child.wake_up().source == "host_copy"
    assert parent.wake_up().source == "shared"
    assert torch.equal(tiny_forward(parent, x), expected)
    # closing the parent keeps the fork's pages
    parent.close()
    assert torch.equal(tiny_forward(child, x), expected)
    assert pool.held_bytes == child.device_bytes
    child.close()
    assert pool.held_bytes == 0 and not pool.has_tenant("weights")


def test_another_checkpoint_shares_the_pool_within_its_budget(tmp_path, model, driver_kind):
    other = save_checkpoint(tmp_path / "o", random_tensors("float32", hidden=64, seed=5))
    d = open_test_driver(driver_kind, 4 * PAGE)
    pool = make_pool(d, 8 * PAGE)
    a = load_weights(model, pool=pool)
    b = load_weights(other, pool=pool)
    assert (a.tenant, b.tenant) == ("weights", "weights.1")
    assert pool.held_bytes == a.device_bytes + b.device_bytes
    assert not a.shares_pages_with(b)
    ca, cb = checksums(a), checksums(b)
    big = save_checkpoint(tmp_path / "big", {"w": torch.zeros(PAGE)})  # 8 MiB: over budget
    with pytest.raises(WeightsOutOfMemory, match="load failed"):
        load_weights(big, pool=pool)
    assert pool.held_bytes == a.device_bytes + b.device_bytes
    b.sleep(1)  # one instance asleep: the other is untouched
    assert checksums(a) == ca and pool.held_bytes == a.device_bytes
    b.wake_up()
    assert checksums(b) == cb
    a.close()
    b.close()
    del a, b
    pool.close()
    d.close()


OPS = st.lists(st.tuples(st.sampled_from(["sleep1", "sleep2", "wake", "fork", "close"]),
                         st.integers(0, 3)), min_size=1, max_size=25)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, keep=st.booleans())
@example(ops=[("sleep1", 0), ("fork", 0), ("sleep2", 0), ("close", 1)], keep=False)
def test_reference_counts_under_random_operations(tmp_path_factory, ops, keep):
    """Random sleep / wake / fork / close over instances of one checkpoint: pages are mapped
    exactly while some instance is awake, every awake instance reads the checkpoint's bytes,
    a host copy exists while an instance is in light sleep and none is awake (it is made when
    the pages go when keep_host_copy=False), and closing all frees everything."""
    model = tmp_path_factory.getbasetemp() / "refcount-model"
    if not model.exists():
        save_checkpoint(model, random_tensors("float32", hidden=32))
    d = open_test_driver("host", 64 << 20)
    pool = make_pool(d, 16 << 20)
    first = load_weights(model, pool=pool, keep_host_copy=keep)
    want = checksums(first)
    live = [first]
    for op, i in ops:
        if not live:
            break
        w = live[i % len(live)]
        if op == "sleep1":
            w.sleep(1)
        elif op == "sleep2":
            w.sleep(2)
        elif op == "wake":
            w.wake_up()
        elif op == "fork":
            live.append(w.fork())
        else:
            w.close()
            live.remove(w)
        awake = [x for x in live if x.state == WAKEUP]
        assert (pool.held_bytes > 0) == bool(awake)
        for x in awake:
            assert checksums(x) == want
        if any(x.state == LIGHT_SLEEP for x in live) and not awake:
            assert live[0].host_copy_bytes > 0  # shared by every instance of the checkpoint
        if live and all(x.state == DEEP_SLEEP for x in live):
            assert live[0].host_copy_bytes == 0
        if keep and awake:
            assert live[0].host_copy_bytes > 0
    for x in live:
        x.close()
    assert pool.held_bytes == 0 and not pool.has_tenant("weights")
    assert d.stats()["handles"] == 0 and d.stats()["mappings"] == 0
    first = live = x = w = None
    pool.close()
    d.close()
