"""Server test fixtures.

``FakeEngine`` is an engine double with the contract-section-4 API, used only for the HTTP
mechanics (routes, errors, limits, admin state machine, disconnects); it produces deterministic
token ids, one per step. Tests of generation itself run the real ``LLMEngine`` (test_real_*.py).
The tokenizer, sampling parameters and output processor are the engine's real ones.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tests.engine.checkpoints import build_tokenizer
from xllm_vmm.engine.output import EngineOutput
from xllm_vmm.engine.request import RequestError
from xllm_vmm.engine.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(d)
    return d


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_dir(tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny fp32 Llama checkpoint with its tokenizer (built once per session)."""
    from tests.engine.checkpoints import llama_checkpoint

    return llama_checkpoint(tmp_path_factory.mktemp("llama"))


def host_vmm_handles() -> int:
    """File descriptors and mappings of host-driver memfds in this process."""
    import os

    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += "xllm-vmm-host" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    with open("/proc/self/maps") as fh:
        n += sum("xllm-vmm-host" in line for line in fh)
    return n


class FakeEngine:
    """Deterministic token stream: token k of a request is ``4 + (sum(prompt) + 7k) % 300``
    (never a special token); one token per step; finishes at max_tokens ("length")."""

    def __init__(self, tokenizer, *, max_model_len: int = 128, step_delay: float = 0.0,
                 name: str = "fake-model"):
        self.tokenizer = tokenizer
        self.model_name = name
        self.max_model_len = max_model_len
        self.step_delay = step_delay
        self.reqs: dict[str, list] = {}
        self.sleeping = False
        self.aborted: list[str] = []
        self.thread_ids: set[int] = set()
        self.shut = False
        self.added = 0
        self.sleep_calls: list[int] = []
        self.script: list[int] | None = None  # when set: the tokens every request emits
        self.run = threading.Event()  # cleared by a test: step() waits (requests stay in flight)
        self.run.set()
        self.in_step = False  # True while step() waits on ``run``

    def _touch(self):
        self.thread_ids.add(threading.get_ident())

    def add_request(self, request_id, prompt_token_ids, params, arrival_time=None):
        self._touch()
        if self.sleeping:
            raise RuntimeError("asleep")
        if len(prompt_token_ids) >= self.max_model_len:
            raise RequestError(param="prompt", message=f"prompt of {len(prompt_token_ids)} tokens "
                                                       f"exceeds max_model_len {self.max_model_len}")
        self.added += 1
        self.reqs[request_id] = [list(prompt_token_ids), params, []]

    def abort_request(self, request_id):
        self._touch()
        if self.reqs.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished_requests(self):
        return bool(self.reqs)

    @property
    def num_running(self):
        return len(self.reqs)

    @property
    def num_waiting(self):
        return 0

    def step(self):
        self._touch()
        self.in_step = True
        self.run.wait(30)
        self.in_step = False
        if self.step_delay:
            time.sleep(self.step_delay)
        outs = []
        for rid, (prompt, params, out) in list(self.reqs.items()):
            tok = (self.script[len(out) % len(self.script)] if self.script else
                   4 + (sum(prompt) + 7 * len(out)) % 300)
            out.append(tok)
            done = len(out) >= (params.max_tokens or 16)
            outs.append(EngineOutput(rid, [tok], finished=done,
                                     finish_reason="length" if done else None,
                                     num_prompt_tokens=len(prompt)))
            if done:
                del self.reqs[rid]
        return outs

    def expected(self, prompt, n):
        return [4 + (sum(prompt) + 7 * k) % 300 for k in range(n)]

    def stats(self):
        return {"num_requests_running": len(self.reqs), "num_requests_waiting": 0,
                "kv_cache_usage_perc": 0.0,
                "prompt_tokens": 0, "generation_tokens": 0,
                "pool": {"reserved_bytes": 1 << 30, "mapped_bytes": 0,
                         "per_tenant_mapped_bytes": {"kv": 0, "weights": 0}}}

    def sleep(self, level=1, drain=False, timeout=None):
        self._touch()
        assert not self.reqs
        self.sleeping = True
        self.sleep_calls.append(level)
        return {"level": level, "bytes_freed": 123}

    def wake_up(self):
        self.sleeping = False
        return {"bytes_mapped": 123}

    def is_sleeping(self):
        return self.sleeping

    def reset_prefix_cache(self):
        return 0

    def fork(self):
        return FakeEngine(self.tokenizer, max_model_len=self.max_model_len,
                          step_delay=self.step_delay, name=self.model_name)

    def shutdown(self):
        self.shut = True
