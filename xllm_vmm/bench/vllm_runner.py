"""Runs vLLM's ``LLM.generate`` for ``xllm-vmm bench engine --vllm-venv`` inside *that* venv's
Python (it never imports xllm_vmm, so the venv needs only vLLM).

Protocol (one JSON object per line): argv[1] is a JSON file ``{"model", "dtype", "prompts":
[[ids]], "new_tokens", "kv_space_gib", "max_model_len", "enable_prefix_caching"}``
(``enable_prefix_caching`` false when absent: the bench runs our engine without its prefix
cache, and the trace's repeats would otherwise hit vLLM's); the runner builds ``LLM`` once,
warms it up, prints ``{"ready": true, "enable_prefix_caching": b, "max_num_batched_tokens":
n, "max_num_seqs": s}`` (the settings vLLM runs with, read back from its config; null when
unreadable); then for every line ``run`` read on stdin it generates
every prompt (token ids, greedy, ``ignore_eos``, ``max_tokens=new_tokens``) and prints
``{"seconds": s, "output_tokens": n, "outputs": [[ids]]}``; ``quit`` (or EOF) ends it. Errors
print ``{"error": "..."}`` and exit 1.
"""

import os
import sys

# this file's directory holds bench modules named like the standard library's (copy.py, ...):
# keep it off the import path of the venv's Python
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

import json  # noqa: E402
import time  # noqa: E402


def _settings(llm) -> dict:
    """What vLLM actually runs with: prefix caching, its per-step token budget and its
    per-step sequence limit."""
    out = {"enable_prefix_caching": None, "max_num_batched_tokens": None, "max_num_seqs": None}
    cfg = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    if cfg is not None:
        out["enable_prefix_caching"] = getattr(cfg.cache_config, "enable_prefix_caching", None)
        out["max_num_batched_tokens"] = getattr(cfg.scheduler_config, "max_num_batched_tokens",
                                                None)
        out["max_num_seqs"] = getattr(cfg.scheduler_config, "max_num_seqs", None)
    return out


def main() -> int:
    spec = json.load(open(sys.argv[1]))
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_space_gib", 2)))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        from vllm import LLM, SamplingParams

        llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
                  skip_tokenizer_init=True, enforce_eager=False, seed=0,
                  enable_prefix_caching=bool(spec.get("enable_prefix_caching", False)))
        settings = _settings(llm)
        sp = SamplingParams(temperature=0, max_tokens=spec["new_tokens"], ignore_eos=True,
                            detokenize=False)
        prompts = [{"prompt_token_ids": list(p)} for p in spec["prompts"]]
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True,
                                                 detokenize=False), use_tqdm=False)
    except Exception as e:  # noqa: BLE001 - reported to the bench, which records it
        import traceback

        traceback.print_exc()
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        return 1
    print(json.dumps({"ready": True, **settings}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "quit":
            break
        if cmd != "run":
            continue
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        ids = [list(o.outputs[0].token_ids) for o in outs]
        print(json.dumps({"seconds": dt, "output_tokens": sum(map(len, ids)), "outputs": ids}),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
