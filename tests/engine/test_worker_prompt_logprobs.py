"""Prompt log-probabilities (``SamplingParams.prompt_logprobs``) against transformers'
``log_softmax`` of the same prompt on a tiny fp32 Llama: vLLM's shape (one entry per prompt
token, None first; the token itself plus the top-k with ranks), through chunked prefill, with
prefix-cache hits (recomputed read-only; the cached blocks unchanged), preemption in a tiny
pool, and ``n`` > 1; bad values name the parameter."""

from __future__ import annotations

import pytest

from tests.engine.checkpoints import llama_checkpoint, load_hf_model
from xllm_vmm import LLM, SamplingParams
from xllm_vmm.engine.request import RequestError

BS = 16


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(5 * i + 13 * salt + 3) % 300 + 4 for i in range(n)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = llama_checkpoint(tmp_path_factory.mktemp("llama_plp"))
    return d, load_hf_model(d)


def hf_prompt_logprobs(hf, ids):
    import torch

    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def check(hf, ids, got, k):
    import torch

    ref = hf_prompt_logprobs(hf, ids)
    assert got is not None and len(got) == len(ids)
    assert got[0] is None
    for pos in range(1, len(ids)):
        d = got[pos]
        row = ref[pos - 1]
        tok = ids[pos]
        assert tok in d, pos
        assert d[tok].logprob == pytest.approx(float(row[tok]), abs=2e-4)
        assert d[tok].rank == int((row > row[tok]).sum()) + 1
        top = torch.topk(row, k).indices.tolist() if k else []
        assert set(d) == set(top) | {tok}, pos
        for t in top:
            assert d[t].logprob == pytest.approx(float(row[t]), abs=2e-4)
        assert all(lp.decoded_token is not None for lp in d.values())


def make(d, **kw):
    kw.setdefault("block_size", BS)
    kw.setdefault("device_memory", "96MiB")
    return LLM(str(d), **kw)


@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_match_hf_with_chunks_and_prefix_hits(llama, k):
    d, hf = llama
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=k)
    long_p = prompt(3 * BS + 5)
    with make(d, enable_vmm_kvcache=True, vmm_elastic=True, max_tokens_per_batch=20,
              enable_prefix_cache=True) as llm:
        outs = llm.generate([long_p, prompt(1, 1), prompt(BS + 1, 2)], sp)
        for o, ids in zip(outs, [long_p, prompt(1, 1), prompt(BS + 1, 2)]):
            check(hf, ids, o.prompt_logprobs, k)
        # the second pass hits the prefix cache (3 full blocks): recomputed, the same values
        eng = llm.llm_engine
        hits = eng.stats()["prefix_cache_hits"]
        again = llm.generate([long_p + [7, 8]], sp)[0]
        assert eng.stats()["prefix_cache_hits"] > hits
        assert again.num_cached_tokens >= 3 * BS
        check(hf, long_p + [7, 8], again.prompt_logprobs, k)
        # the read-only recompute wrote nothing: a third pass still generates what HF does
        plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        a = llm.generate([long_p], plain)[0].outputs[0].token_ids
    with make(d, enable_prefix_cache=False) as ref_llm:
        assert ref_llm.generate([long_p], plain)[0].outputs[0].token_ids == a


def test_prompt_logprobs_off_by_default_and_with_n_and_preemption(llama):
    d, hf = llama
    with make(d, enable_vmm_kvcache=True, vmm_elastic=True) as llm:
        out = llm.generate([prompt(9)], SamplingParams(temperature=0, max_tokens=1))[0]
        assert out.prompt_logprobs is None
        out = llm.generate([prompt(2 * BS, 4)], SamplingParams(
            temperature=0.8, seed=1, n=2, max_tokens=3, prompt_logprobs=1))[0]
        check(hf, prompt(2 * BS, 4), out.prompt_logprobs, 1)
        # max_tokens=1: the first output is the last; the list still arrives
        out = llm.generate([prompt(5, 5)], SamplingParams(temperature=0, max_tokens=1,
                                                          prompt_logprobs=2))[0]
        check(hf, prompt(5, 5), out.prompt_logprobs, 2)


def test_prompt_logprobs_through_preemption(tmp_path):
    d = llama_checkpoint(tmp_path / "wide", num_attention_heads=8, num_key_value_heads=8,
                         head_dim=256)
    hf = load_hf_model(d)
    with make(d, enable_vmm_kvcache=True, vmm_elastic=True, max_cache_size=4 * 2 * 1024 * 1024,
              enable_prefix_cache=False) as llm:
        prompts = [prompt(40, s) for s in range(6)]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=30,
                                                    ignore_eos=True, prompt_logprobs=1))
        assert llm.llm_engine.stats()["num_preemptions"] > 0
        for p, o in zip(prompts, outs):
            check(hf, p, o.prompt_logprobs, 1)


def test_bad_prompt_logprobs_name_the_parameter():
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(RequestError) as e:
            SamplingParams(prompt_logprobs=bad)
        assert e.value.param == "prompt_logprobs"


def test_read_only_step_refuses_chunks_with_an_offset(llama):
    from xllm_vmm.engine.step import SeqChunk, StepInput

    d, _ = llama
    with make(d) as llm:
        worker = llm.llm_engine.worker
        step = StepInput.build([SeqChunk("x", [5, 6], 16, {"attn": [0, 1]}, True)], BS)
        step.write_kv = False
        with pytest.raises(ValueError, match="read-only"):
            worker.execute(step)


def test_decode_steps_after_the_prompt_compute_nothing_extra(llama):
    """Once a request's prompt log-probabilities are delivered, its decode steps flag no chunk
    and run no read-only recompute: one worker call per engine step (a prefix hit's recompute
    happens once, in the step of the hit), however many tokens follow."""
    d, hf = llama
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=1)
    p = prompt(2 * BS + 3, 6)
    with make(d, enable_prefix_cache=True) as llm:
        eng = llm.llm_engine
        llm.generate([p], SamplingParams(temperature=0, max_tokens=1))  # cache 2 blocks
        calls = []
        real = eng.worker.execute
        eng.worker.execute = lambda step: calls.append(step) or real(step)
        steps = eng.num_steps
        out = llm.generate([p + [9]], sp)[0]
        check(hf, p + [9], out.prompt_logprobs, 1)
        assert out.num_cached_tokens == 2 * BS
        # the hit's recompute + one execute per engine step
        assert len(calls) == (eng.num_steps - steps) + 1
        assert sum(not s.write_kv for s in calls) == 1
        assert not any(c.prompt_logprobs for s in calls[2:] for c in s.chunks)
