"""A vocabulary the workers do not divide: ``ceil(V / W)`` rows per worker, the last worker's
share shorter, its logit slice padded with ``-inf`` and cut on rank 0 (as vLLM pads its
``VocabParallelEmbedding``). Greedy output with 2 and 4 workers equals one worker's, token for
token, on a tiny fp32 Llama whose vocabulary (387 = 384 tokenizer ids + 3 extra rows, as
published models pad theirs) divides neither 2 nor 4."""

from __future__ import annotations

import json

import pytest

from tests.distributed.conftest import BASE, alive
from tests.engine.checkpoints import _rewrite_tensors, llama_checkpoint
from xllm_vmm import LLM, SamplingParams

VOCAB = 387
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(300, 340))]  # ids of the last shard


@pytest.fixture(scope="module")
def odd_vocab_dir(tmp_path_factory):
    import torch

    out = llama_checkpoint(tmp_path_factory.mktemp("tp-odd-vocab"))
    cfg = json.loads((out / "config.json").read_text())
    extra = VOCAB - cfg["vocab_size"]
    assert extra > 0
    cfg["vocab_size"] = VOCAB
    (out / "config.json").write_text(json.dumps(cfg))
    gen = torch.Generator().manual_seed(7)

    def pad(name, t):
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            # the extra rows are real rows: the head may pick them (they sit in the last shard)
            return torch.cat([t, 2.0 * torch.randn(extra, t.shape[1], generator=gen)])
        return t

    _rewrite_tensors(out, pad)
    return out


def run(model, **flags):
    llm = LLM(model=str(model), **BASE, **flags)
    eng = llm.llm_engine
    try:
        for i, p in enumerate(PROMPTS):  # token ids in and out: an extra id has no text
            eng.add_request(f"r{i}", p, GREEDY)
        toks: dict[str, list[int]] = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                toks.setdefault(o.request_id, []).extend(o.new_token_ids)
        rows = eng.weights["model.embed_tokens.weight"].shape[0]
        head = eng.weights["lm_head.weight"].shape[0]
        pids = [s["pid"] for s in eng.distributed.worker_stats()] if eng.distributed else []
        return [toks[f"r{i}"] for i in range(len(PROMPTS))], rows, head, pids
    finally:
        eng.shutdown()


@pytest.mark.parametrize("world", [2, 4])
def test_padded_vocabulary_equals_one_worker(odd_vocab_dir, world):
    one, rows1, _, _ = run(odd_vocab_dir)
    many, rows, head, pids = run(odd_vocab_dir, nnodes=world)
    assert rows1 == VOCAB
    part = -(-VOCAB // world)
    assert rows == head == part  # rank 0 holds a full share; the last rank holds the rest
    assert any(t >= VOCAB - 3 for ts in one for t in ts)  # the last shard's rows are chosen
    assert many == one
    assert all(len(t) == GREEDY.max_tokens for t in many)
    assert not any(alive(p) for p in pids[1:])
