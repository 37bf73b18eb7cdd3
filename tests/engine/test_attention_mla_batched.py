"""The MLA backend's batched multi-row chunks (speculative verify chunks of ``1 + k`` rows, the
MTP draft's catch-up chunks): one gather + one SDPA call per bucket gives, row for row, what
one call per chunk gives (``batch_chunks=False``) and what a reference over each sequence's
whole history gives, on random latents and queries, in steps that mix them with decodes, a
prefill from position 0, chunks of other row counts and a long chunked-prefill chunk, with
scattered (shuffled) blocks, float32 and bfloat16. End to end (token for token with and
without speculation) is ``test_spec_engine.py``."""

from __future__ import annotations

import math

import pytest
import torch

from xllm_vmm.engine.attention.kv import KVGeometry
from xllm_vmm.engine.attention.mla import (MAX_BATCHED_CHUNK_ROWS, MLATorchBackend,
                                           PagedLatent)
from xllm_vmm.engine.attention.torch_sdpa import DECODE_BUCKET_MIN
from xllm_vmm.engine.step import SeqChunk, StepInput

BS, BPS, SLOTS = 4, 8, 64  # block size, blocks per slot (page), slots
H, L, V = 3, 24, 16  # heads, latent width (c + k_rope), value width (kv_lora_rank)


def _paged(dtype) -> tuple[KVGeometry, PagedLatent]:
    page = BPS * BS * L
    # unwritten keys: large finite values (a padding or future key attended would dominate)
    flat = (torch.randn(SLOTS * page, generator=torch.Generator().manual_seed(5)) * 30).to(dtype)
    geo = KVGeometry("mla", BS, BPS, SLOTS * BPS, BS * L, 1, BPS)
    return geo, PagedLatent(flat.view(SLOTS, BPS * BS, L), flat.view(SLOTS, BPS, BS, L),
                            flat.view(-1, BS * L))


def _reference(q: torch.Tensor, keys: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """(n, H, L) queries at positions start.., (N, L) keys -> (n, H, V), float64."""
    s = torch.einsum("nhl,kl->nhk", q.double(), keys.double()) * scale
    n, N = q.shape[0], keys.shape[0]
    allowed = torch.arange(N)[None, :] <= torch.arange(start, start + n)[:, None]
    s = s.masked_fill(~allowed[:, None, :], float("-inf"))
    return torch.einsum("nhk,kv->nhv", torch.softmax(s, -1), keys[:, :V].double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_chunks_equal_per_chunk_and_reference(dtype):
    g = torch.Generator().manual_seed(11)
    geo, kv = _paged(dtype)
    scale = 1 / math.sqrt(L)
    fast = MLATorchBackend(geo, num_heads=H, latent_dim=L, value_dim=V, scale=scale,
                           device="cpu")
    slow = MLATorchBackend(geo, num_heads=H, latent_dim=L, value_dim=V, scale=scale,
                           device="cpu", batch_chunks=False)
    free = torch.randperm(SLOTS * BPS, generator=g).tolist()  # scattered blocks
    tables: dict[str, list[int]] = {}
    history: dict[str, list[torch.Tensor]] = {}
    n_verify = DECODE_BUCKET_MIN + 3  # several verify chunks of 4 rows (K = 3)
    prompt = {f"v{i}": int(torch.randint(1, 40, (1,), generator=g)) for i in range(n_verify)}
    prompt.update({"d0": 9, "d1": 30, "k2a": 5, "k2b": 17, "one": 12, "long": 3})
    steps = [[(r, n) for r, n in prompt.items()],
             [(f"v{i}", 4) for i in range(n_verify)] + [("d0", 1), ("d1", 1), ("k2a", 3),
                                                         ("k2b", 3), ("one", 2), ("long", 40),
                                                         ("fresh", 6)],
             [(f"v{i}", 1 + i % 4) for i in range(n_verify)] + [("k2a", 3), ("k2b", 3)]]
    for plan in steps:
        chunks = []
        for rid, n in plan:
            done = sum(x.shape[0] for x in history.get(rid, []))
            need = -(-(done + n) // BS)
            table = tables.setdefault(rid, [])
            while len(table) < need:
                table.append(free.pop())
            chunks.append(SeqChunk(rid, [1] * n, done, {"mla": list(table)}, True))
        step = StepInput.build(chunks, BS)
        t = step.num_tokens
        q = torch.randn(t, H, L, generator=g).to(dtype)
        latent = torch.randn(t, L, generator=g).to(dtype)
        meta = fast.prepare(step)
        ref_meta = slow.prepare(step)
        assert not ref_meta.chunk_batches
        fast.write(kv, latent, meta)
        got = fast.attend(q, latent, kv, meta)
        want = slow.attend(q, latent, kv, ref_meta)
        assert fast.workspace_bytes(meta, latent.element_size()) > 0
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        qsl = step.query_start_loc.tolist()
        for i, (rid, n) in enumerate(plan):
            history.setdefault(rid, []).append(latent[qsl[i]:qsl[i + 1]])
            keys = torch.cat(history[rid])
            ref = _reference(q[qsl[i]:qsl[i + 1]], keys, keys.shape[0] - n, scale)
            torch.testing.assert_close(got[qsl[i]:qsl[i + 1]].double(), ref,
                                       atol=tol * 3, rtol=tol * 3)
        batched = {q0 for b in meta.chunk_batches for q0 in b.q0s}
        starts = dict(zip((r for r, _ in plan), qsl))
        if plan is steps[1]:
            # the verify chunks (4 rows) and the two 3-row chunks are batched; one 2-row chunk,
            # the long chunk, the fresh prefill and the decodes are not
            assert {starts[f"v{i}"] for i in range(n_verify)} <= batched
            assert {starts["k2a"], starts["k2b"]} <= batched
            assert not {starts["one"], starts["long"], starts["fresh"], starts["d0"]} & batched
            assert all(b.n <= MAX_BATCHED_CHUNK_ROWS for b in meta.chunk_batches)
        if plan is steps[2]:
            assert {b.n for b in meta.chunk_batches} >= {2, 3, 4}
