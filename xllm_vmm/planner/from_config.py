"""Plan inputs from a resolved configuration (the same sources as ``check-config``).

Flags read: ``nnodes``, ``devices`` and ``dp_size`` (the workers: :mod:`xllm_vmm.config.parallel`;
``tp_size`` is the DiT backend's only, as in the engine), ``block_size``,
``kv_cache_dtype``, ``max_memory_utilization``, ``max_cache_size``, ``vmm_memory_reserve_bytes``,
``enable_vmm_kvcache``, ``enable_vmm_weights``, ``vmm_elastic``, ``enable_prefix_cache``,
``host_blocks_factor``, ``max_seqs_per_batch``, ``max_tokens_per_batch``,
``enable_chunked_prefill``,
``num_speculative_tokens``, ``speculative_algorithm``, ``phy_page_granularity_size`` (the page).
The device, host memory, context length and execution-peak figures come from ``plan``'s own
options (they are not engine flags).
"""

from __future__ import annotations

from typing import Any

from xllm_vmm.planner.inputs import PlanInputs


def workers_from_config(cfg: Any) -> int:
    """The service's workers as the engine counts them: ``nnodes × len(devices)`` (one process
    per ``nnodes``, one worker per device of its ``devices``; :mod:`xllm_vmm.config.parallel`).
    Raises :class:`~xllm_vmm.models.ModelConfigError` for a ``devices`` list that is not valid
    (a device listed twice, a malformed entry)."""
    from xllm_vmm.config.parallel import parallel_of
    from xllm_vmm.models import ModelConfigError

    devices = str(cfg.get("devices", "") or "").strip()
    where = cfg.provenance("devices") if hasattr(cfg, "provenance") else "devices"
    try:
        return parallel_of(cfg).world
    except ValueError as err:
        # The hint fits the error: a duplicate, or an entry that is not KIND[:INDEX] of one kind
        # (the message already names the kinds, and "did you mean" for an alias such as gpu).
        text = str(err)
        hint = "list each device once, e.g. npu:0,npu:1" if "listed twice" in text else \
            "" if "did you mean" in text else \
            "list devices of one kind as KIND:INDEX, comma-separated, e.g. npu:0,npu:1"
        raise ModelConfigError(f"devices={devices} (from {where}): {err}", hint=hint) from None


def inputs_from_config(cfg: Any, **plan_options: Any) -> PlanInputs:
    """A :class:`PlanInputs` from ``cfg`` (anything with ``cfg["flag"]``), with ``plan``'s own
    options (``device_memory_bytes``, ``device_name``, ``host_memory_bytes``, ``context_len``,
    ``execution_peak_bytes``, ``runtime_overhead_bytes``, ``workers``) on top; options that
    are None are left at their defaults."""
    values = dict(
        workers=workers_from_config(cfg),
        dp_size=max(1, int(cfg.get("dp_size", 1) or 1)),
        block_size=int(cfg["block_size"]),
        kv_cache_dtype=str(cfg["kv_cache_dtype"]),
        max_memory_utilization=float(cfg["max_memory_utilization"]),
        max_cache_size=int(cfg["max_cache_size"]),
        vmm_memory_reserve_bytes=int(cfg["vmm_memory_reserve_bytes"]),
        enable_vmm_kvcache=bool(cfg["enable_vmm_kvcache"]),
        enable_vmm_weights=bool(cfg["enable_vmm_weights"]),
        vmm_elastic=bool(cfg["vmm_elastic"]),
        enable_prefix_cache=bool(cfg["enable_prefix_cache"]),
        host_blocks_factor=float(cfg["host_blocks_factor"]),
        max_seqs_per_batch=int(cfg["max_seqs_per_batch"]),
        max_tokens_per_batch=int(cfg["max_tokens_per_batch"]),
        enable_chunked_prefill=bool(cfg["enable_chunked_prefill"]),
        num_speculative_tokens=int(cfg["num_speculative_tokens"]),
        speculative_algorithm=str(cfg["speculative_algorithm"]),
    )
    if "phy_page_granularity_size" in cfg:
        values["page_bytes"] = int(cfg["phy_page_granularity_size"])
    values.update({k: v for k, v in plan_options.items() if v is not None})
    return PlanInputs(**values)


def draft_from_config(cfg: Any):
    """The separate draft model of ``cfg``: a :class:`~xllm_vmm.models.ModelSpec` read from
    ``draft_model`` when speculative decoding is on (``num_speculative_tokens > 0``) and
    ``draft_model`` is a local directory with a ``config.json`` (or that file); else None (an MTP
    draft is then estimated from the target's MTP layers). Raises
    :class:`~xllm_vmm.models.ModelConfigError` naming ``draft_model`` and where it was set when
    that config.json cannot be read."""
    from pathlib import Path

    from xllm_vmm.models import ModelConfigError, load_model_spec

    ref = str(cfg.get("draft_model", "") or "").strip()
    if not ref or int(cfg["num_speculative_tokens"]) <= 0:
        return None
    path = Path(ref).expanduser()
    if not ((path.is_dir() and (path / "config.json").is_file())
            or (path.is_file() and path.suffix == ".json")):
        return None
    try:
        return load_model_spec(str(path))
    except ModelConfigError as err:
        where = cfg.provenance("draft_model") if hasattr(cfg, "provenance") else "draft_model"
        raise ModelConfigError(f"draft_model (from {where}): {err.message}",
                               source=err.source, hint=err.hint) from err
