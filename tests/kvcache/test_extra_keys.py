"""Extra hash keys through the manager: a request's ``cache_salt`` (vLLM's field) and adapter
(``lora``) enter its first block's hash, so requests that differ in either never share a block
— on the device or through the host tier — and requests that agree share as before. Exact
block ids."""

from __future__ import annotations

import pytest

from tests.kvcache.test_manager import BS, Env, toks
from xllm_vmm.kvcache.hashing import block_hashes, request_extra_keys


def _run(m, rid, tokens, **keys):
    hit = m.lookup(rid, tokens, **keys)
    t = m.allocate(rid, len(tokens) - hit.num_tokens, hit=hit)
    assert t is not None
    m.commit(rid, len(tokens), tokens)
    return hit.num_tokens, list(t["attn"])


def test_request_extra_keys():
    assert request_extra_keys() == ()
    assert request_extra_keys(cache_salt="s", lora="x") == ("lora:x", "salt:s")
    assert request_extra_keys(lora=3) == ("lora:3",)
    assert request_extra_keys(cache_salt="x") != request_extra_keys(lora="x")
    for bad in ("", 5):
        with pytest.raises(ValueError, match="cache_salt"):
            request_extra_keys(cache_salt=bad)
    with pytest.raises(ValueError, match="lora"):
        request_extra_keys(lora=1.5)


def test_different_salts_never_share_blocks(env):
    e = env()
    m = e.mgr
    p = toks(1, 2)  # 9 tokens: blocks 0 and 1 complete
    assert _run(m, "a", p, cache_salt="alice") == (0, [0, 1, 2])
    m.free("a")  # 0, 1 cached under alice's hashes
    assert _run(m, "b", p, cache_salt="bob") == (0, [2, 3, 4])  # no hit: fresh blocks
    assert _run(m, "c", p) == (0, [5, 6, 7])  # no salt: no hit either
    assert _run(m, "d", p, lora="alice") == (0, [8, 9, 10])  # an adapter named like the salt
    assert _run(m, "e", p, cache_salt="alice") == (8, [0, 1, 11])  # the same salt: shared
    assert _run(m, "f", p, cache_salt="bob") == (8, [2, 3, 12])
    assert _run(m, "g", p, cache_salt="alice", lora="alice") == (0, [13, 14, 15])
    # the index holds the chain of the manager's documented hash, salt in block 0
    want = block_hashes(p, BS, extra_keys=request_extra_keys(cache_salt="alice"))
    assert [m.prefix.block_of("attn", h) for h in want] == [0, 1]
    plain = block_hashes(p, BS)
    assert [m.prefix.block_of("attn", h) for h in plain] == [5, 6]
    m.check_invariants()


def test_salt_of_a_prompt_shorter_than_a_block_reaches_its_first_block(env):
    """The first complete block is hashed at commit (decode), not at lookup: the salt still
    enters it."""
    e = env()
    m = e.mgr
    m.lookup("a", [1, 2, 3], cache_salt="s")
    assert m.allocate("a", 3) == {"attn": [0]}
    m.commit("a", 3, [1, 2, 3])
    m.allocate("a", 2)
    m.commit("a", 5, [1, 2, 3, 4, 5])  # block 0 complete: published under the salt
    m.free("a")
    assert m.lookup("x", [1, 2, 3, 4, 5]).num_tokens == 0
    assert m.lookup("y", [1, 2, 3, 4, 5], cache_salt="s").num_tokens == 4
    assert m.lookup("z", [1, 2, 3, 4, 5], cache_salt="t").num_tokens == 0
    for r in "xyz":
        m.drop(r)
    m.check_invariants()


def test_salt_separates_host_tier_hits(env):
    e = env("host", budget_slots=1, host_factor=4.0)
    m = e.mgr
    _run(m, "a", toks(1, 2, tail=0), cache_salt="s")  # blocks 0, 1
    m.free("a")
    m.step()
    m.host.wait_all()
    assert m.stats()["host_offloaded_blocks"] == 2
    # b's shortfall goes by exact LRU: a's tail block (released first) leaves the device,
    # its first block stays
    _run(m, "b", toks(8, 9, 10, tail=0))
    m.free("b")
    for salt, want in ((None, (0, 0)), ("t", (0, 0)), ("s", (4, 4))):
        hit = m.lookup("c", toks(1, 2, 3), cache_salt=salt)
        assert (hit.num_device_tokens, hit.num_host_tokens) == want, salt
        m.drop("c")
    m.check_invariants()
