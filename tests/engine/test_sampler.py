"""SamplingParams validation and the sampler against hand-computed distributions."""

import math

import pytest
import torch

from xllm_vmm.engine.request import Request, RequestError
from xllm_vmm.engine.sampler import Sampler, argmax_rows, top_logprobs
from xllm_vmm.engine.sampling_params import SamplingParams

P = [0.5, 0.3, 0.15, 0.05]
LOGITS = torch.tensor([math.log(p) for p in P])


def req(params, prompt=(1, 2), out=(), eos=(3,), rid="r"):
    r = Request(rid, list(prompt), params, eos_token_ids=tuple(eos))
    r.output_token_ids = list(out)
    return r


def probs(**kw):
    return Sampler.probabilities(LOGITS.unsqueeze(0), [SamplingParams(**kw)])[0].tolist()


@pytest.mark.parametrize(
    "kw, expected",
    [
        ({}, P),
        ({"top_k": 2}, [0.625, 0.375, 0, 0]),
        ({"top_k": -1}, P),
        ({"top_k": 9}, P),
        ({"top_p": 0.7}, [0.625, 0.375, 0, 0]),          # smallest set with mass >= 0.7
        ({"top_p": 0.85}, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
        ({"top_p": 0.1}, [1, 0, 0, 0]),                   # the most likely token always stays
        ({"min_p": 0.5}, [0.625, 0.375, 0, 0]),           # keep p >= 0.25
        ({"min_p": 0.2}, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
        ({"temperature": 2.0}, [math.sqrt(p) / sum(math.sqrt(q) for q in P) for p in P]),
        ({"temperature": 0.5}, [p * p / sum(q * q for q in P) for p in P]),
        ({"top_k": 3, "top_p": 0.8}, [0.625, 0.375, 0, 0]),  # top-p over the renormalised top-3
    ],
)
def test_distribution(kw, expected):
    assert probs(**kw) == pytest.approx(expected, abs=1e-6)


def test_top_k_keeps_ties():
    x = torch.tensor([[1.0, 2.0, 2.0, 0.0]])
    p = Sampler.probabilities(x, [SamplingParams(top_k=1)])[0]
    assert p.tolist() == pytest.approx([0, 0.5, 0.5, 0])


def test_greedy_is_argmax_first_on_ties_and_ignores_filters():
    s = Sampler(seed=0)
    x = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 0.0, 0.0, 9.0]])
    out = s.sample(x, [req(SamplingParams(temperature=0)), req(SamplingParams(temperature=0, top_k=1))])
    assert out.token_ids == [1, 3]
    assert out.logprobs == [None, None]


def test_penalties_hand_computed():
    # repetition 2 over prompt+output tokens {0, 1}; frequency 0.5 / presence 0.25 over outputs
    s = Sampler()
    x = torch.tensor([[2.0, -1.0, 0.5, 0.4]])
    r = req(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=(0,), out=(1,))
    # after: [1.0, -2.0, 0.5, 0.4] -> argmax 0
    assert s.sample(x, [r]).token_ids == [0]
    r = req(SamplingParams(temperature=0, repetition_penalty=4.0), prompt=(0,), out=(1,))
    # [0.5, -4, 0.5, 0.4] -> tie: first index
    assert s.sample(x, [r]).token_ids == [0]
    r = req(SamplingParams(temperature=0, repetition_penalty=5.0), prompt=(0,), out=())
    assert s.sample(x, [r]).token_ids == [2]  # 0.4 < 0.5
    # outputs [2, 2, 0]: counts [1, 0, 2, 0]; logits - 0.5*count - 0.25*(count>0)
    x = torch.tensor([[2.0, 1.0, 3.0, 1.2]])
    r = req(SamplingParams(temperature=0, frequency_penalty=0.5, presence_penalty=0.25), out=(2, 2, 0))
    # [2 - .75, 1, 3 - 1.25, 1.2] = [1.25, 1, 1.75, 1.2] -> 2
    assert s.sample(x, [r]).token_ids == [2]
    r = req(SamplingParams(temperature=0, frequency_penalty=1.0, presence_penalty=0.0), out=(2, 2, 0))
    # [1, 1, 1, 1.2] -> 3
    assert s.sample(x, [r]).token_ids == [3]
    # the caller's logits are left untouched
    assert x.tolist() == torch.tensor([[2.0, 1.0, 3.0, 1.2]]).tolist()


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    s = Sampler()
    x = torch.tensor([[0.0, 0.0, 1.0, 9.0, 8.0]])   # eos 3 most likely, then stop id 4
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[4])
    assert s.sample(x, [req(p, out=(0,))]).token_ids == [2]
    assert s.sample(x, [req(p, out=(0, 1))]).token_ids == [3]
    # ignore_eos: eos is not masked by min_tokens (it is not a stop token then), stop ids are
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[4], ignore_eos=True)
    assert s.sample(x, [req(p, out=(0,))]).token_ids == [3]


def test_seeded_request_reproducible_whatever_runs_beside_it():
    x = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=1.0, seed=1234)

    def run(batch_mates):
        s = Sampler(seed=batch_mates)
        r = req(p)
        toks = []
        for _ in range(20):
            others = [req(SamplingParams(temperature=1.0), rid=f"o{i}") for i in range(batch_mates)]
            rows = torch.cat([x] * (batch_mates + 1))
            toks.append(s.sample(rows, others + [r]).token_ids[-1])
        return toks

    a, b, c = run(0), run(3), run(5)
    assert a == b == c
    assert len(set(a)) > 1  # it does sample


def test_sampling_frequencies_follow_the_distribution():
    s = Sampler(seed=7)
    n = 4000
    rows = LOGITS.unsqueeze(0).repeat(n, 1)
    toks = s.sample(rows, [req(SamplingParams(top_k=3), rid=str(i)) for i in range(n)]).token_ids
    freq = [toks.count(t) / n for t in range(4)]
    expected = [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]
    assert freq[3] == 0
    for f, e in zip(freq, expected):
        assert abs(f - e) < 0.03


def test_logprobs_raw_with_ranks():
    x = torch.tensor([[math.log(p) for p in P]])
    p = SamplingParams(temperature=0, logprobs=2, repetition_penalty=3.0)
    out = Sampler().sample(x, [req(p, prompt=(0,))])
    # penalty moves the argmax to 1, logprobs stay the raw model's
    assert out.token_ids == [1]
    lp = out.logprobs[0]
    assert set(lp) == {0, 1}
    assert lp[0].logprob == pytest.approx(math.log(0.5)) and lp[0].rank == 1
    assert lp[1].logprob == pytest.approx(math.log(0.3)) and lp[1].rank == 2
    d = top_logprobs(torch.log(torch.tensor(P)), 3, 1)
    assert set(d) == {3, 0} and d[3].rank == 4 and d[0].rank == 1
    assert set(top_logprobs(torch.log(torch.tensor(P)), 2, 0)) == {2}


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop": [1]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logprobs": 21}, "logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"n": 0}, "n"),
        ({"seed": "x"}, "seed"),
    ],
)
def test_params_validation_names_the_parameter(kw, param):
    with pytest.raises(RequestError) as e:
        SamplingParams(**kw)
    assert e.value.param == param
    assert param in e.value.message


def test_params_derived():
    p = SamplingParams(stop="x", top_k=-1, temperature=0.0, seed=5, n=3)
    assert p.stop_strings == ["x"] and p.top_k_effective == 0 and p.greedy
    assert p.for_sibling(2).seed == 7 and p.for_sibling(2).n == 1
    assert SamplingParams().max_tokens == 16  # vLLM's default


def test_request_stop_checks():
    r = req(SamplingParams(max_tokens=3, stop_token_ids=[7]), eos=(3,))
    r.output_token_ids = [5]
    assert r.check_stop(5, 100) is None
    r.output_token_ids = [5, 3]
    assert r.check_stop(3, 100).finish_reason == "stop" and r.stop_reason is None
    r.output_token_ids = [5, 7]
    assert r.check_stop(7, 100).finish_reason == "stop" and r.stop_reason == 7
    r.output_token_ids = [5, 6, 6]
    assert r.check_stop(6, 100).finish_reason == "length"
    r.output_token_ids = [5]
    assert r.check_stop(5, 3).finish_reason == "length"  # max_model_len: 2 prompt + 1 output
    r = req(SamplingParams(ignore_eos=True), eos=(3,))
    r.output_token_ids = [3]
    assert r.check_stop(3, 100) is None


def test_plain_greedy_batch_equals_the_general_path():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    logits[2, [7, 9]] = 100.0  # a tie: the first index, as torch.argmax
    plain = [req(SamplingParams(temperature=0), rid=f"r{i}") for i in range(6)]
    fast = Sampler(0).sample(logits, plain)
    assert fast.token_ids == logits.argmax(dim=-1).tolist() and fast.token_ids[2] == 7
    assert fast.logprobs == [None] * 6
    # the same rows through the general path (one request asks for logprobs)
    mixed = plain[:5] + [req(SamplingParams(temperature=0, logprobs=1), rid="r5")]
    slow = Sampler(0).sample(logits, mixed)
    assert slow.token_ids == fast.token_ids and slow.logprobs[5] is not None
    # min_tokens not reached keeps the general path (EOS masked)
    logits2 = logits.clone()
    logits2[0, 3] = 1000.0  # EOS would win
    held = [req(SamplingParams(temperature=0, min_tokens=2), rid="m")] + plain[1:]
    sampler = Sampler(0)
    assert sampler.sample(logits2, held).token_ids[0] != 3
    held[0].output_token_ids = [5, 6]  # min_tokens reached: the raw argmax again (EOS)
    assert sampler.sample(logits2, held).token_ids[0] == 3


def test_argmax_rows_picks_torch_argmax_first_index_ties_and_nans_included():
    """The numpy path of the greedy argmax equals ``torch.argmax`` (first index on ties, a NaN
    is the maximum) on CPU float32, contiguous or not; other dtypes go through torch."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 300, generator=g)
    x[3, [5, 200]] = 50.0  # a tie
    x[7, [9, 11]] = float("nan")
    x[8] = 0.0  # all equal
    assert argmax_rows(x) == x.argmax(dim=-1).tolist()
    assert argmax_rows(x)[3] == 5 and argmax_rows(x)[7] == 9 and argmax_rows(x)[8] == 0
    cols = x[:, ::3]  # a strided view
    assert argmax_rows(cols) == cols.argmax(dim=-1).tolist()
    with torch.inference_mode():
        y = torch.randn(5, 40, generator=g)
    assert argmax_rows(y) == y.argmax(dim=-1).tolist()
    b = x.to(torch.bfloat16)
    assert argmax_rows(b) == b.argmax(dim=-1).tolist()
