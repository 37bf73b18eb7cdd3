from array import array

import pytest
import xxhash

from xllm_vmm.kvcache.hashing import (
    MediaSpan,
    RequestHasher,
    block_hashes,
    sha256_block_hashes,
)


def test_first_block_hash_is_xxh3_128_of_zero_parent_and_uint32_tokens():
    toks = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    hs = block_hashes(toks, 4, seed=1024)
    assert len(hs) == 2  # the partial third block has no hash (PC-01)
    h0 = xxhash.xxh3_128_intdigest(bytes(16) + array("I", [1, 2, 3, 4]).tobytes(), 1024)
    h1 = xxhash.xxh3_128_intdigest(h0.to_bytes(16, "big") + array("I", [5, 6, 7, 8]).tobytes(),
                                   1024)
    assert hs == [h0, h1]


def test_seed_changes_every_hash():
    toks = list(range(8))
    a, b = block_hashes(toks, 4, seed=1024), block_hashes(toks, 4, seed=7)
    assert a[0] != b[0] and a[1] != b[1]


def test_chain_shares_prefix_and_diverges_after_first_difference():
    a = block_hashes(list(range(12)), 4)
    b = block_hashes(list(range(8)) + [99, 10, 11, 12], 4)
    assert a[:2] == b[:2]
    assert a[2] != b[2]
    # same tokens in block 1 but a different block 0: block 1 differs too (chain)
    c = block_hashes([0, 1, 2, 5] + list(range(4, 8)), 4)
    assert c[1] != a[1]


def test_media_changes_only_covered_blocks_and_their_successors():
    toks = list(range(16))
    plain = block_hashes(toks, 4)
    img1 = block_hashes(toks, 4, media=[MediaSpan(offset=5, length=4, hash="img-a")])
    img2 = block_hashes(toks, 4, media=[MediaSpan(offset=5, length=4, hash="img-b")])
    assert img1[0] == plain[0]  # block 0 covers tokens 0..3, the image starts at 5
    assert img1[1] != plain[1] and img1[2] != plain[2] and img1[3] != plain[3]
    assert img1[1] != img2[1]


def test_extra_keys_change_block_zero_and_everything_after():
    toks = list(range(8))
    plain = block_hashes(toks, 4)
    salted = block_hashes(toks, 4, extra_keys=["lora:a"])
    assert salted[0] != plain[0] and salted[1] != plain[1]
    assert block_hashes(toks, 4, extra_keys=["lora:a"]) == salted


def test_request_hasher_matches_full_hash_whatever_the_chunking():
    toks = list(range(1, 30))
    full = block_hashes(toks, 4, media=[MediaSpan(9, 6, b"\x01\x02")], extra_keys=[3])
    r = RequestHasher(4, media=[MediaSpan(9, 6, b"\x01\x02")], extra_keys=[3])
    assert r.extend(toks[:3]) == []
    assert r.extend(toks[3:10]) == full[:2]
    r.extend(toks[10:11])
    r.extend(toks[11:])
    assert r.hashes == full and len(full) == 7 and r.num_tokens == 29


@pytest.mark.parametrize("bad", [-1, 2**32])
def test_out_of_range_token_is_refused_with_its_value(bad):
    with pytest.raises(ValueError, match=rf"token id {bad} is outside 0..4294967295"):
        block_hashes([1, 2, bad, 3], 4)


def test_block_size_must_be_positive():
    with pytest.raises(ValueError, match="block_size=0"):
        block_hashes([1], 0)


def test_sha256_chain_has_one_hash_per_complete_block():
    hs = sha256_block_hashes(list(range(10)), 4)
    assert len(hs) == 2 and all(len(h) == 32 for h in hs) and hs[0] != hs[1]
