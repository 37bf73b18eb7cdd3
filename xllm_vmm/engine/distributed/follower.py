"""A worker of rank > 0 started by rank 0 (``python -m xllm_vmm.engine.distributed.follower
SPEC``, see :mod:`.spawn`): builds the engine from the same flags, serves rank 0's commands,
releases everything and exits (0: shut down by rank 0; 2: start-up failed, the message on
stderr; 3: rank 0 is gone)."""

from __future__ import annotations

import json
import sys


def run_worker(model: str, flags: dict, opts: dict | None = None) -> int:
    """Build this rank's engine and serve rank 0 until shutdown (see the module docstring)."""
    from xllm_vmm.engine.llm_engine import LLMEngine

    try:
        eng = LLMEngine.from_flags(model, **flags, **(opts or {}))
    except Exception as e:  # noqa: BLE001 - the start-up error, in words, for the operator
        print(f"xllm-vmm worker rank {flags.get('node_rank')}: start-up failed: "
              f"{type(e).__name__}: {e}", file=sys.stderr)
        return 2
    try:
        return eng.distributed.serve(eng)
    finally:
        eng.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    spec = json.loads(args[0])
    return run_worker(spec["model"], spec["flags"], spec.get("opts"))


if __name__ == "__main__":
    import os

    code = main()
    # The engine is shut down (pool, mappings, process group released); leave without the
    # interpreter's teardown, where torch.distributed's store threads still calling a rank 0
    # that is gone can abort the process (see xllm_vmm.cli.serve._leave).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
