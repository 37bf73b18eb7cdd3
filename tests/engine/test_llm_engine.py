"""LLMEngine / LLM end to end: greedy token ids identical to Hugging Face ``generate`` on tiny
fp32 checkpoints (tests/engine/checkpoints.py), across memory modes, prompt lengths around
block boundaries, prefix-cache second passes, host-tier restores, chunked prefill, preemption
in a tiny pool, batched and one at a time; flags validated as check-config validates them;
the pool idle again after many requests."""

from __future__ import annotations

import pytest

from tests.engine.checkpoints import hf_greedy, llama_checkpoint, load_hf_model
from xllm_vmm import LLM, SamplingParams
from xllm_vmm.config import ConfigError
from xllm_vmm.engine.request import RequestError

BS = 16
NEW = 6
LENGTHS = (1, BS - 1, BS, BS + 1, 3 * BS + 5)
MODES = {
    "physical": {},
    "fixed": {"enable_vmm_kvcache": True},
    "elastic": {"enable_vmm_kvcache": True, "vmm_elastic": True},
}
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + 11 * salt + 5) % 300 + 4 for i in range(n)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = llama_checkpoint(tmp_path_factory.mktemp("llama"))
    return d, load_hf_model(d)


@pytest.fixture(scope="module")
def refs(llama):
    d, hf = llama
    cache: dict[tuple[int, ...], list[int]] = {}

    def ref(ids: list[int], n: int = NEW) -> list[int]:
        key = (*ids, -n)
        if key not in cache:
            cache[key] = hf_greedy(hf, ids, n)
        return cache[key]

    return ref


def make(d, **kw):
    kw.setdefault("block_size", BS)
    kw.setdefault("device_memory", "96MiB")
    kw.setdefault("max_tokens_per_batch", 512)
    return LLM(str(d), **kw)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_greedy_matches_hf_batched_and_one_at_a_time_with_a_prefix_pass(llama, refs, mode):
    d, _ = llama
    with make(d, **MODES[mode]) as llm:
        prompts = [prompt(n, n) for n in LENGTHS]
        batched = llm.generate(prompts, GREEDY)
        for p, o in zip(prompts, batched):
            assert o.outputs[0].token_ids == refs(p), f"{mode}: prompt of {len(p)} tokens"
            assert o.outputs[0].finish_reason == "length"
        # second pass: the prefix cache serves every complete block but the last token's
        again = llm.generate(prompts, GREEDY)
        for p, o in zip(prompts, again):
            assert o.outputs[0].token_ids == refs(p)
            assert o.num_cached_tokens == (len(p) - 1) // BS * BS
        for p in prompts[:2]:  # one at a time
            assert llm.generate([p], GREEDY)[0].outputs[0].token_ids == refs(p)
        eng = llm.llm_engine
        assert eng.stats()["prefix_cache_hits"] > 0
        assert eng.kv_cache_manager.stats()["live_blocks"] == 0
        assert eng.sizing["running"]["mode"] == {"physical": "physical", "fixed": "fixed",
                                                 "elastic": "elastic"}[mode]


def test_prompt_forms_and_chunked_prefill(llama, refs):
    d, _ = llama
    with make(d, max_tokens_per_batch=8, enable_prefix_cache=False) as llm:
        p = prompt(3 * BS + 5, 3)
        tok = llm.get_tokenizer()
        text = "hello world, a test"
        outs = llm.generate([p, {"prompt_token_ids": p}, text], GREEDY)
        assert outs[0].outputs[0].token_ids == refs(p) == outs[1].outputs[0].token_ids
        assert outs[2].prompt == text and outs[2].prompt_token_ids == tok.encode(text)
        assert outs[2].outputs[0].token_ids == refs(tok.encode(text))
        # a single list of ints is one prompt
        one = llm.generate(p, GREEDY)
        assert len(one) == 1 and one[0].outputs[0].token_ids == refs(p)
        assert llm.llm_engine.num_steps > len(p) // 8


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A Llama whose KV takes 8 KiB per token per tensor (8 KV heads x head_dim 256 x fp32):
    one 2 MiB page holds 256 tokens, so a one-slot pool (4 tensors x 2 MiB) is tiny."""
    d = llama_checkpoint(tmp_path_factory.mktemp("wide"), num_attention_heads=8,
                         num_key_value_heads=8, head_dim=256)
    hf = load_hf_model(d)
    cache: dict[tuple[int, ...], list[int]] = {}

    def ref(ids: list[int], n: int) -> list[int]:
        key = (*ids, -n)
        if key not in cache:
            cache[key] = hf_greedy(hf, ids, n)
        return cache[key]

    return d, ref


ONE_SLOT = 4 * 2 * 1024 * 1024  # one page per K/V tensor of 2 layers: 256 tokens


def test_preemption_in_a_tiny_pool_keeps_outputs_exact(wide):
    d, ref = wide
    with make(d, enable_vmm_kvcache=True, vmm_elastic=True, max_cache_size=ONE_SLOT,
              enable_prefix_cache=False) as llm:
        assert llm.llm_engine.kv_cache_manager.capacity().total_tokens >= 256
        prompts = [prompt(40, s) for s in range(6)]   # 6 x (40 + 30) tokens > 256
        sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        outs = llm.generate(prompts, sp)
        eng = llm.llm_engine
        assert eng.stats()["num_preemptions"] > 0
        for p, o in zip(prompts, outs):
            assert o.outputs[0].token_ids == ref(p, 30)
        assert eng.kv_cache_manager.stats()["live_blocks"] == 0


def test_host_tier_restores_keep_outputs_exact(wide):
    d, ref = wide
    with make(d, enable_vmm_kvcache=True, vmm_elastic=True, enable_prefix_cache=True,
              host_blocks_factor=4, max_cache_size=ONE_SLOT) as llm:
        first = prompt(100, 1)
        sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        assert llm.generate([first], sp)[0].outputs[0].token_ids == ref(first, 4)
        # other prompts fill the one device slot: first's cached blocks leave the device
        for s in range(2, 5):
            llm.generate([prompt(200, s)], sp)
        again = llm.generate([first], sp)[0]
        st = llm.llm_engine.kv_cache_manager.stats()
        assert st["host_restored_blocks"] > 0 and again.num_cached_tokens == 96
        assert again.outputs[0].token_ids == ref(first, 4)


def test_pool_idle_after_many_requests(llama):
    d, _ = llama
    with make(d, enable_vmm_kvcache=True, vmm_elastic=True, max_tokens_per_batch=256,
              max_seqs_per_batch=16) as llm:
        sp = SamplingParams(temperature=0.9, max_tokens=3, seed=1, ignore_eos=True)
        for r in range(25):  # 1,000 requests
            llm.generate([prompt(5 + (i * 7) % 40, 100 * r + i) for i in range(40)], sp)
        eng = llm.llm_engine
        kv = eng.kv_cache_manager.stats()
        assert kv["live_blocks"] == 0 and kv["requests"] == 0
        eng.reset_prefix_cache()
        eng.kv_cache_manager.step()
        kv = eng.kv_cache_manager.stats()
        assert kv["cached_blocks"] == 0
        assert kv["mapped_bytes"] == kv["packed_floor_bytes"]
        assert eng.stats()["request_success"] == {"length": 1000}


def test_seeded_sampling_reproducible_whatever_runs_beside(llama):
    d, _ = llama
    with make(d) as llm:
        sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=42, ignore_eos=True)
        alone = llm.generate([prompt(20)], sp)[0].outputs[0].token_ids
        others = SamplingParams(temperature=1.0, max_tokens=8)
        mixed = llm.generate([prompt(30, 1), prompt(20), prompt(9, 2)], [others, sp, others])
        assert mixed[1].outputs[0].token_ids == alone


def test_parallel_samples_share_the_prompt_blocks(llama):
    d, _ = llama
    with make(d) as llm:
        p = prompt(3 * BS + 2, 9)
        o = llm.generate([p], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5,
                                              ignore_eos=True))[0]
        assert [c.index for c in o.outputs] == [0, 1, 2]
        assert len({tuple(c.token_ids) for c in o.outputs}) > 1
        assert o.num_cached_tokens == 3 * BS  # a sibling ran on the shared prompt blocks


@pytest.mark.parametrize("tokens_per_batch", [512, 24])
def test_prompts_on_one_prefix_submitted_together_share_it(llama, refs, tokens_per_batch):
    """Prompts that share two blocks arrive together: the later ones wait for the first's
    prefill of those blocks and are admitted on them (with chunked prefill too); the greedy
    outputs equal Hugging Face's, token for token."""
    d, _ = llama
    head = prompt(2 * BS + 3, 4)
    prompts = [head + prompt(5 + i, 20 + i) for i in range(3)]
    with make(d, max_tokens_per_batch=tokens_per_batch) as llm:
        outs = llm.generate(prompts, GREEDY)
        for p, o in zip(prompts, outs):
            assert o.outputs[0].token_ids == refs(p)
        assert outs[0].num_cached_tokens == 0
        assert [o.num_cached_tokens for o in outs[1:]] == [2 * BS, 2 * BS]
        assert llm.llm_engine.kv_cache_manager.stats()["live_blocks"] == 0


def test_prompts_on_one_prefix_with_preemption_and_the_host_tier_keep_outputs_exact(wide):
    d, ref = wide
    with make(d, enable_vmm_kvcache=True, vmm_elastic=True, max_cache_size=ONE_SLOT,
              enable_prefix_cache=True, host_blocks_factor=2.0) as llm:
        head = prompt(2 * BS + 1, 3)
        prompts = [head + prompt(30, s) for s in range(6)]  # 6 x (63 + 30) tokens > 256
        sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        outs = llm.generate(prompts, sp)
        for p, o in zip(prompts, outs):
            assert o.outputs[0].token_ids == ref(p, 30)
        assert any(o.num_cached_tokens >= 2 * BS for o in outs[1:])
        assert llm.llm_engine.kv_cache_manager.stats()["live_blocks"] == 0


def test_step_outputs_name_their_parent_and_sample_index(llama):
    d, _ = llama
    with make(d) as llm:
        eng = llm.llm_engine
        eng.add_request("p", prompt(BS + 3, 4), SamplingParams(n=2, temperature=1.0, seed=5,
                                                                 max_tokens=3, ignore_eos=True))
        eng.add_request("q", prompt(5, 6), SamplingParams(temperature=0, max_tokens=2,
                                                           ignore_eos=True))
        seen: dict[str, list] = {}
        while eng.has_unfinished_requests():
            for r in eng.step():
                seen.setdefault(r.request_id, []).append((r.parent_request_id, r.index,
                                                          r.finished))
        assert sorted(seen) == ["p#0", "p#1", "q"]
        assert {x[:2] for x in seen["p#0"]} == {("p", 0)}
        assert {x[:2] for x in seen["p#1"]} == {("p", 1)}
        assert {x[:2] for x in seen["q"]} == {("q", 0)}
        assert all(v[-1][2] and not any(x[2] for x in v[:-1]) for v in seen.values())
        assert not eng._children and not eng._parent  # finished: the engine forgot them


def test_stop_strings_and_stop_token_ids(llama, refs):
    d, _ = llama
    with make(d) as llm:
        tok = llm.get_tokenizer()
        p = prompt(10, 4)
        full = refs(p, 12)
        text = tok.decode(full)
        stop_tok = full[3]
        o = llm.generate([p], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                             stop_token_ids=[stop_tok]))[0].outputs[0]
        assert o.token_ids == full[:full.index(stop_tok) + 1] and o.finish_reason == "stop"
        assert o.stop_reason == stop_tok
        cut = text[len(tok.decode(full[:2])):][:2]  # two characters after the second token
        assert cut.strip()  # deterministic checkpoint: "id"
        o = llm.generate([p], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                             stop=[cut]))[0].outputs[0]
        assert o.finish_reason == "stop" and o.stop_reason == cut
        assert cut not in o.text and text.startswith(o.text)
        assert "abort" not in llm.llm_engine.stats()["request_success"]
        assert llm.llm_engine.kv_cache_manager.stats()["live_blocks"] == 0


def test_logprobs_and_min_tokens(llama):
    d, _ = llama
    with make(d) as llm:
        o = llm.generate([prompt(8)], SamplingParams(temperature=0, max_tokens=3, logprobs=2,
                                                     ignore_eos=True))[0].outputs[0]
        assert len(o.logprobs) == 3
        for tid, d_ in zip(o.token_ids, o.logprobs):
            assert tid in d_ and d_[tid].rank == 1 and len(d_) == 2  # greedy: sampled is top-1
        assert o.cumulative_logprob == pytest.approx(sum(d_[t].logprob for t, d_ in
                                                         zip(o.token_ids, o.logprobs)))


def test_request_errors_name_the_parameter(llama):
    d, _ = llama
    with make(d, max_model_len=64) as llm:
        assert llm.llm_engine.max_model_len == 64
        with pytest.raises(RequestError) as e:
            llm.generate([prompt(64)], GREEDY)
        assert e.value.param == "prompt" and "64" in e.value.message
        with pytest.raises(RequestError) as e:
            llm.generate([[1, 2, 10 ** 6]], GREEDY)
        assert e.value.param == "prompt_token_ids"
        with pytest.raises(RequestError) as e:
            llm.generate([[]], GREEDY)
        assert e.value.param == "prompt"
        with pytest.raises(RequestError) as e:
            llm.generate([prompt(3), prompt(4)], [GREEDY])
        assert e.value.param == "sampling_params"
        assert not llm.llm_engine.has_unfinished_requests()


def test_flags_validated_by_the_config_code(llama):
    from xllm_vmm.config import load
    from xllm_vmm.config.rules import check

    d, _ = llama
    with pytest.raises(ConfigError) as e:
        LLM(str(d), enable_vmm_kvcache=True, enable_task_pipeline=True)
    cfg = load([f"--model={d}", "--enable_vmm_kvcache=true", "--enable_task_pipeline=true"])
    want = [f.message for f in check(cfg).findings if f.severity == "error"]
    assert [f.message for f in e.value.findings] == want and want
    assert str(e.value).startswith(want[0])
    with pytest.raises(ConfigError, match="block_sise") as e:
        LLM(str(d), block_sise=16)
    assert e.value.findings[0].id == "CFG-UNKNOWN"
    with pytest.raises(ConfigError) as e:
        LLM(str(d), block_size=16, device_memory="4MiB")
    assert e.value.findings[0].id in ("MEMORY", "CONTEXT")


@pytest.mark.parametrize("mode", ["fixed", "physical"])
def test_plan_and_the_running_cache_agree(llama, mode):
    """`xllm-vmm plan` with the same flags, device memory and context length sizes the KV
    cache the engine builds (per-group blocks, tokens)."""
    import json

    from typer.testing import CliRunner

    from xllm_vmm.cli.app import app

    d, _ = llama
    flags = {"block_size": BS, "max_tokens_per_batch": 512, **MODES[mode]}
    with make(d, max_model_len=256, **flags) as llm:
        running = llm.llm_engine.sizing["running"]
    args = ["plan", "--model", str(d), "--device-memory", "96MiB", "--runtime-overhead", "0",
            "--context-len", "256", "--format", "json"]
    args += [f"--{k}={str(v).lower()}" for k, v in flags.items()]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.stdout + r.stderr
    w = json.loads(r.stdout)["per_worker"][0]
    planned_blocks = {g["name"]: g["blocks"] for g in w["groups"]}
    if mode == "fixed":
        assert running["kv_capacity_blocks"] == planned_blocks
        assert running["kv_capacity_tokens"] == w["kv_capacity_tokens"]
    else:  # physical: the plan counts blocks, the cache whole pages per tensor (< 1 slot less)
        for g, n in planned_blocks.items():
            per_slot = w["blocks_per_page"][g]
            assert n - per_slot < running["kv_capacity_blocks"][g] <= n


def test_without_chunked_prefill_a_prompt_must_fit_one_step(llama, refs):
    d, _ = llama
    with make(d, enable_chunked_prefill=False, max_tokens_per_batch=32) as llm:
        with pytest.raises(RequestError) as e:
            llm.generate([prompt(33)], GREEDY)
        assert e.value.param == "prompt" and "max_tokens_per_batch=32" in e.value.message
        p = prompt(32, 5)
        assert llm.generate([p], GREEDY)[0].outputs[0].token_ids == refs(p)


def test_abort_mid_flight_frees_everything(llama, refs):
    d, _ = llama
    with make(d, max_tokens_per_batch=32) as llm:
        eng = llm.llm_engine
        sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        eng.add_request("keep", prompt(20, 1), sp)
        eng.add_request("gone", prompt(40, 2), sp)
        eng.add_request("pair", prompt(18, 3), SamplingParams(n=2, seed=1, max_tokens=8))
        with pytest.raises(RequestError) as e:
            eng.add_request("pair", prompt(5), sp)
        assert e.value.param == "request_id"
        with pytest.raises(RequestError):
            eng.add_request("pair#1", prompt(5), sp)
        eng.step()
        eng.step()
        eng.abort_request(["gone", "pair", "nobody"])
        toks: dict[str, list[int]] = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                toks.setdefault(o.request_id, []).extend(o.new_token_ids)
        assert set(toks) <= {"keep"}
        assert eng.kv_cache_manager.num_requests == 0
        assert eng.kv_cache_manager.stats()["live_blocks"] == 0
        assert eng.stats()["request_success"] == {"abort": 3, "length": 1}
        eng.add_request("pair", prompt(5), sp)  # ids are free again
        eng.abort_request("pair")


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3", "qwen3_moe"])
def test_every_family_matches_hf_through_llm(tmp_path, family):
    import tests.engine.checkpoints as ck

    d = getattr(ck, f"{family}_checkpoint")(tmp_path / family)
    hf = load_hf_model(d)
    prompts = [prompt(n, n) for n in (1, BS + 1, 5 * BS + 3)]  # llama3: past its original 64
    with make(d, enable_vmm_kvcache=True, vmm_elastic=True) as llm:
        outs = llm.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, NEW), f"{family}: {len(p)} tokens"


@pytest.mark.parametrize("vmm_weights", [False, True])
def test_progress_reports_every_weight_byte_loaded(llama, vmm_weights):
    """The ``progress`` option (serve's load bar) sees the load grow to its total, and the total
    is the checkpoint's tensor bytes (plain tensors or the pool's weights tenant)."""
    from safetensors import safe_open

    d, _ = llama
    calls: list[tuple[int, int]] = []
    flags = {"enable_vmm_kvcache": True, "vmm_elastic": True,
             "enable_vmm_weights": True} if vmm_weights else {}
    with make(d, progress=lambda done, total: calls.append((done, total)), **flags):
        assert calls, "progress was never called"
        dones = [c[0] for c in calls]
        assert dones == sorted(dones)
        done, total = calls[-1]
        assert done == total
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            nbytes = sum(f.get_tensor(k).nbytes for k in f.keys())
        assert total == nbytes


def test_the_gc_heap_is_frozen_while_an_engine_lives(llama):
    """Construction freezes the collector's heap (a full collection walked every object, ~85 ms
    inside a decode step); the last engine's shutdown unfreezes it, so cyclic garbage made
    before the engine is collectable again afterwards."""
    import gc
    import weakref

    import xllm_vmm.engine.llm_engine as le

    class Node:
        pass

    d, _ = llama
    before = le._frozen_engines
    a = Node()
    a.self = a  # a cycle: only the collector frees it
    ref = weakref.ref(a)
    with make(d) as llm:
        del a
        assert le._frozen_engines == before + 1
        assert gc.get_freeze_count() > 0
        gc.collect()
        assert ref() is not None, "a frozen object was collected"
        assert llm.generate([prompt(5)], GREEDY)[0].outputs[0].token_ids
    assert le._frozen_engines == before
    if before == 0:
        assert gc.get_freeze_count() == 0
        gc.collect()
        assert ref() is None, "the cycle made before the engine outlived its shutdown"
