"""A request's own bad seed or non-finite logits fail that request alone: the sampler reports
the row, the engine ends it with finish_reason "error" and a message, and every other request
of the same step goes on as if it ran alone."""

from __future__ import annotations

import math

import pytest
import torch

from tests.engine.checkpoints import llama_checkpoint
from xllm_vmm.engine.request import Request, RequestError
from xllm_vmm.engine.sampler import Sampler
from xllm_vmm.engine.sampling_params import SEED_MAX, SEED_MIN, SamplingParams


def req(params, rid):
    return Request(rid, [1, 2], params, eos_token_ids=(3,))


@pytest.mark.parametrize("kw", [{"seed": 2 ** 64}, {"seed": -(2 ** 63) - 1},
                                {"seed": 2 ** 64 - 2, "n": 3}])
def test_seed_outside_what_a_generator_takes_is_refused_naming_seed(kw):
    with pytest.raises(RequestError) as e:
        SamplingParams(**kw)
    assert e.value.param == "seed" and "2**64 - 1" in e.value.message


def test_seed_bounds_are_accepted():
    SamplingParams(seed=SEED_MIN)
    SamplingParams(seed=SEED_MAX)
    SamplingParams(seed=SEED_MAX - 2, n=3)


def test_a_seed_the_generator_refuses_fails_its_row_alone():
    good = SamplingParams(temperature=1.0, seed=7)
    bad = SamplingParams(temperature=1.0, seed=7)
    object.__setattr__(bad, "seed", 2 ** 64)  # past validation, as a caller could mutate it
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]] * 3))
    rows = [req(good, "a"), req(bad, "b"), req(SamplingParams(temperature=0.0), "c")]
    out = Sampler(0).sample(logits, rows)
    assert set(out.errors) == {1} and "seed" in out.errors[1]
    alone = Sampler(0).sample(logits[:1], [req(SamplingParams(temperature=1.0, seed=7), "a")])
    assert out.token_ids[0] == alone.token_ids[0] and out.token_ids[2] == 0


@pytest.mark.parametrize("poison", [math.nan, math.inf])
def test_non_finite_logits_fail_their_row_alone(poison):
    logits = torch.tensor([[0.0, 2.0, 1.0], [0.0, 1.0, 3.0], [0.0, -math.inf, 1.0]])
    logits[1, 0] = poison
    greedy = SamplingParams(temperature=0.0)
    rows = [req(greedy, "a"), req(greedy, "b"), req(SamplingParams(temperature=1.0, seed=1), "c")]
    out = Sampler(0).sample(logits, rows)
    assert set(out.errors) == {1} and "not finite" in out.errors[1]
    assert out.token_ids[0] == 1  # greedy argmax of the finite row; -inf is a masked token
    assert out.token_ids[2] != 1


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from xllm_vmm.engine import LLM

    d = llama_checkpoint(tmp_path_factory.mktemp("llama"))
    llm = LLM(str(d), block_size=16, device_memory="96MiB", max_tokens_per_batch=512)
    yield llm
    llm.shutdown()


def _poison_rows(llm, monkeypatch, rids):
    """Make the logits of requests ``rids`` NaN in every step (a NaN checkpoint's effect)."""
    eng = llm.llm_engine
    real = eng.sampler.sample

    def sample(logits, rows):
        logits = logits.clone()
        for i, r in enumerate(rows):
            if r.request_id in rids:
                logits[i] = float("nan")
        return real(logits, rows)

    monkeypatch.setattr(eng.sampler, "sample", sample)


def test_offline_generate_fails_only_the_request_with_non_finite_logits(llm, monkeypatch):
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ref = llm.generate([[5, 6, 7, 8]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    start = next(llm._ids)
    _poison_rows(llm, monkeypatch, {f"llm-{start + 2}"})
    outs = llm.generate([[5, 6, 7, 8], [9, 10, 11]], greedy, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == ref
    bad = outs[1].outputs[0]
    assert bad.finish_reason == "error" and "not finite" in str(bad.stop_reason)
    eng = llm.llm_engine
    assert not eng.has_unfinished_requests()
    assert eng.kv_cache_manager.stats()["live_blocks"] == 0


def test_a_distribution_made_non_finite_by_its_parameters_fails_its_row_alone():
    logits = torch.tensor([[5.0, 1.0, 0.5], [5.0, 1.0, 0.5]])
    bad = SamplingParams(temperature=1.0, repetition_penalty=1.0)
    object.__setattr__(bad, "repetition_penalty", 1e-323)  # past validation: divides to inf
    rows = [Request("a", [0], SamplingParams(temperature=1.0, seed=3), eos_token_ids=(9,)),
            Request("b", [0], bad, eos_token_ids=(9,))]
    out = Sampler(0).sample(logits, rows)
    assert set(out.errors) == {1} and "repetition_penalty" in out.errors[1]


def test_a_denormal_repetition_penalty_is_refused():
    with pytest.raises(RequestError) as e:
        SamplingParams(repetition_penalty=1e-323)
    assert e.value.param == "repetition_penalty" and "at least 1e-06" in e.value.message
