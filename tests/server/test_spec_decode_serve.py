"""``xllm-vmm serve`` with an MTP draft (``--draft_model --speculative_algorithm=MTP
--num_speculative_tokens=K``): the official openai client gets the same greedy completions as
from ``serve`` without the draft, and ``/metrics`` shows vLLM's ``vllm:spec_decode_*``
counters (only on the speculating server)."""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import openai
import pytest

from tests.engine import checkpoints as C
from xllm_vmm.bench.mtp_draft import untrained_mtp
from tests.server.test_serve_cli import _start
from xllm_vmm.bench.serve import parse_metric

PROMPTS = ["hello world", "the quick brown fox jumps over the lazy dog " * 3, "a", "ok then"]
K = 2


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_serve")
    target = C.deepseek_v3_checkpoint(root / "target")
    return target, untrained_mtp(target, root / "draft")


def _serve_and_ask(target, extra):
    args = ["--model", str(target), "--port", "0", "--enable_vmm_kvcache=true",
            "--vmm_elastic=true", "--block_size=16", "--max-model-len=256",
            "--device-memory=256MiB", *extra]
    proc, lines, url = _start(args)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)

        def ask(p):
            r = client.completions.create(model=client.models.list().data[0].id, prompt=p,
                                          max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
            return r.choices[0].text, r.usage.completion_tokens

        with cf.ThreadPoolExecutor(4) as ex:  # concurrent: one batch on the engine
            answers = list(ex.map(ask, PROMPTS))
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except Exception:
            proc.kill()
            raise
    return answers, metrics, "".join(lines)


def test_serve_with_a_draft_answers_as_without_and_counts_drafts(pair):
    target, draft = pair
    plain, m_plain, _ = _serve_and_ask(target, [])
    spec, m_spec, log = _serve_and_ask(target, [f"--draft_model={draft}",
                                                "--speculative_algorithm=MTP",
                                                f"--num_speculative_tokens={K}"])
    assert "draft_model" not in log.split("accepted without effect")[-1].split("\n")[0]
    assert [n for _, n in spec] == [12] * len(PROMPTS)
    assert spec == plain
    assert "spec_decode" not in m_plain
    drafts = parse_metric(m_spec, "vllm:spec_decode_num_drafts_total")
    draft_tokens = parse_metric(m_spec, "vllm:spec_decode_num_draft_tokens_total")
    accepted = parse_metric(m_spec, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafts >= len(PROMPTS)
    assert drafts <= draft_tokens <= K * drafts
    assert 0 <= accepted <= draft_tokens
    per_pos = [parse_metric(m_spec, "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                            {"position": str(i)}) for i in range(K)]
    assert sum(per_pos) == accepted
