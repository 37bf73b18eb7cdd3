"""Tokenizer wrapper, incremental detokenization and the OutputProcessor (stop strings)."""

import pytest

from tests.engine.checkpoints import build_tokenizer
from xllm_vmm.engine.detokenizer import IncrementalDetokenizer
from xllm_vmm.engine.output import EngineOutput, Logprob, OutputProcessor
from xllm_vmm.engine.sampling_params import SamplingParams
from xllm_vmm.engine.tokenizer import Tokenizer, TokenizerError


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(d)
    return Tokenizer.from_dir(d)


def test_tokenizer_roundtrip_and_chat_template_matches_transformers(tok, tmp_path):
    from transformers import AutoTokenizer

    d = tmp_path / "t"
    build_tokenizer(d)
    hf = AutoTokenizer.from_pretrained(str(d))
    text = "héllo wörld, ünïcode ✓ 漢字"
    assert tok.encode(text) == hf.encode(text)
    assert tok.decode(tok.encode(text)) == text
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"},
            {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}]
    for gen in (True, False):
        assert tok.apply_chat_template(msgs, add_generation_prompt=gen) == hf.apply_chat_template(
            msgs, add_generation_prompt=gen, tokenize=False)
    ids = tok.apply_chat_template(msgs, tokenize=True)
    assert ids == tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False)
    assert tok.eos_token_ids  # from tokenizer_config / generation_config


def test_tokenizer_errors(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{nope")
    with pytest.raises(TokenizerError, match="cannot be read"):
        Tokenizer.from_dir(tmp_path)


def test_incremental_detokenizer_never_emits_broken_utf8(tok):
    text = "a ✓ 漢字 é 🙂 end"
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode("prompt ", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, prompt)
    deltas = [d.add([t]) for t in ids]
    d.flush()
    assert all("\ufffd" not in x for x in deltas)
    assert "".join(deltas) == d.text == tok.decode(ids)
    # some multi-byte character is split over tokens (else this test would prove nothing)
    assert any(x == "" for x in deltas)


def test_flush_emits_an_incomplete_tail(tok):
    ids = tok.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1
    d = IncrementalDetokenizer(tok, [])
    assert d.add(ids[:-1]) == ""
    assert d.flush() == tok.decode(ids[:-1])


def feed(proc, rid, tok, text, finish_at_end=True, reason="length"):
    ids = tok.encode(text, add_special_tokens=False)
    ups = []
    aborted = []
    for i, t in enumerate(ids):
        last = finish_at_end and i == len(ids) - 1
        res = proc.process([EngineOutput(rid, [t], finished=last, finish_reason=reason if last else None)])
        ups.extend(res.updates)
        aborted.extend(res.to_abort)
        if ups and ups[-1].finished:
            break
    return ups, aborted


def test_text_without_stop_strings_streams_what_the_general_path_does(tok):
    # the no-stop-string path (each delta = the detokenizer's) against the held-back one
    text = "a ✓ 漢字 é 🙂 end, and more"
    plain, held = OutputProcessor(tok), OutputProcessor(tok)
    plain.add_request("a", SamplingParams(), [1, 2])
    held.add_request("a", SamplingParams(stop=["\u2603never"]), [1, 2])  # never matches
    ups_p, _ = feed(plain, "a", tok, text)
    ups_h, _ = feed(held, "a", tok, text)
    assert "".join(u.delta_text for u in ups_p) == "".join(u.delta_text for u in ups_h) == text
    assert all("\ufffd" not in u.delta_text for u in ups_p)
    assert [u.delta_token_ids for u in ups_p] == [u.delta_token_ids for u in ups_h]
    assert (ups_p[-1].finished, ups_p[-1].finish_reason) == (True, "length")
    assert plain.pop("a").outputs[0].text == text


def test_stop_string_truncates_and_asks_for_abort(tok):
    proc = OutputProcessor(tok)
    proc.add_request("a", SamplingParams(stop=["STOP", "zz"]), [1, 2])
    ups, aborted = feed(proc, "a", tok, "hello world STOP more text")
    st = proc.states["a"]
    assert st.text == "hello world "
    assert st.finish_reason == "stop" and st.stop_reason == "STOP"
    assert aborted == ["a"]
    assert "".join(u.delta_text for u in ups) == "hello world "  # held-back text never leaked
    assert ups[-1].finished


def test_stop_string_included_when_asked_and_min_tokens_respected(tok):
    proc = OutputProcessor(tok)
    proc.add_request("a", SamplingParams(stop="lo", include_stop_str_in_output=True), [1])
    feed(proc, "a", tok, "hello hello")
    assert proc.states["a"].text == "hello"
    n = len(tok.encode("hello world", add_special_tokens=False))
    proc.add_request("b", SamplingParams(stop="lo", min_tokens=n, max_tokens=n + 5), [1])
    feed(proc, "b", tok, "hello world")
    assert proc.states["b"].text == "hello world"  # no stop check before min_tokens
    assert proc.states["b"].finish_reason == "length"


def test_engine_finish_reasons_and_logprobs_pass_through(tok):
    proc = OutputProcessor(tok)
    proc.add_request("a", SamplingParams(logprobs=1), [1])
    t = tok.encode("x", add_special_tokens=False)[0]
    res = proc.process([EngineOutput("a", [t], True, "stop", 99, [{t: Logprob(-0.5, 1)}], 1, 0)])
    ro = proc.pop("a")
    assert ro.finished and len(ro.outputs) == 1 and not proc.has("a")
    c = ro.outputs[0]
    assert (c.finish_reason, c.stop_reason, c.text) == ("stop", 99, "x")
    assert c.logprobs[0][t].decoded_token == "x" and c.cumulative_logprob == -0.5
    assert res.to_abort == [] and c.token_ids == [t]


def test_token_ids_only_requests_skip_text_and_keep_the_finish(tok):
    proc = OutputProcessor(tok)
    proc.add_request("a", SamplingParams(detokenize=False, stop=["x"]), [1])
    t = tok.encode("x", add_special_tokens=False)[0]
    res = proc.process([EngineOutput("a", [t, t], False, parent_request_id="a")])
    u = res.updates[0]
    assert (u.delta_text, u.delta_token_ids, u.finished, res.to_abort) == ("", [t, t], False, [])
    res = proc.process([EngineOutput("a", [t], True, "stop", 7, num_prompt_tokens=1,
                                     num_cached_tokens=0)])
    u = res.updates[0]
    assert (u.finished, u.finish_reason, u.stop_reason, u.num_prompt_tokens) == (True, "stop", 7, 1)
    ro = proc.pop("a")
    c = ro.outputs[0]
    assert (c.text, c.token_ids, c.finish_reason, c.logprobs) == ("", [t, t, t], "stop", None)


def test_parallel_samples_tracked_under_child_ids(tok):
    proc = OutputProcessor(tok)
    sts = proc.add_request("p", SamplingParams(n=2, seed=3), [1])
    assert [s.request_id for s in sts] == ["p#0", "p#1"] and sts[1].params.seed == 4
    t = tok.encode("x", add_special_tokens=False)[0]
    res = proc.process([EngineOutput("p#1", [t], True, "length")])
    assert (res.updates[0].parent_id, res.updates[0].index) == ("p", 1)
    assert not proc.finished("p")
    proc.process([EngineOutput("p#0", [t, t], True, "length")])
    ro = proc.request_output("p")
    assert proc.finished("p") and [o.index for o in ro.outputs] == [0, 1]
    assert [o.text for o in ro.outputs] == ["xx", "x"]
    with pytest.raises(ValueError, match="already tracked"):
        proc.add_request("p", SamplingParams(), [1])
