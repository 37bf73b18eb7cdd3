"""``xllm-vmm plan``: dry-run sizing of a serving configuration.

Takes the same inputs as ``check-config`` (``--FLAG=VALUE`` in gflags syntax, ``--config`` TOML
files, ``--config_json_file``, ``XLLM_VMM_*`` environment variables), checks every rule first,
then prints the sizing plan (:mod:`xllm_vmm.planner`). Exit codes: 0 fits, 1 does not fit (or the
configuration has errors), 2 usage error, unreadable input or unknown model/device.
Nothing here imports torch.
"""

from __future__ import annotations

import os

from enum import Enum
from typing import List, Optional

import typer

from xllm_vmm.cli.app import app


class PlanFormat(str, Enum):
    table = "table"
    json = "json"
    toml = "toml"


def _fail(message: str) -> "typer.Exit":
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


def _list_models(fmt: PlanFormat) -> None:
    from xllm_vmm.models import catalogue_names, load_model_spec

    rows = []
    for name in catalogue_names():
        s = load_model_spec(name)
        rows.append({"name": name, "architecture": s.architecture, "layers": s.num_layers,
                     "params": s.param_count, "weights_bytes": s.served_weight_bytes,
                     "dtype": s.dtype, "max_position_embeddings": s.max_position_embeddings,
                     "mla": s.mla is not None, "hybrid": s.is_hybrid, "vision": s.vision,
                     "mtp_layers": s.mtp_layers, "experts": s.num_experts})
    if fmt is PlanFormat.json:
        import json

        typer.echo(json.dumps(rows, indent=2))
        return
    if fmt is PlanFormat.toml:
        import tomli_w

        typer.echo(tomli_w.dumps({"models": rows}))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title="Model catalogue (xllm-vmm plan --model NAME)")
    for col in ("name", "layers", "params", "dtype", "context", "features"):
        t.add_column(col, justify="right" if col in ("layers", "params", "context") else "left",
                     no_wrap=col == "name")
    for r in rows:
        feats = [f for f, on in (("MLA", r["mla"]), ("hybrid", r["hybrid"]), ("VLM", r["vision"]),
                                 (f"MTP x{r['mtp_layers']}", r["mtp_layers"]),
                                 (f"MoE {r['experts']}", r["experts"])) if on]
        t.add_row(r["name"], str(r["layers"]), f"{r['params'] / 1e9:,.1f}B", r["dtype"],
                  f"{r['max_position_embeddings']:,}", ", ".join(feats))
    Console().print(t)


@app.command(
    "plan",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def plan_command(
    ctx: typer.Context,
    list_models: bool = typer.Option(False, "--list-models", help="List the model catalogue."),
    device: Optional[str] = typer.Option(
        None, "--device", help="Device profile: ascend-910b-64g (default), ascend-910b-32g, "
        "h200, h100-80g, a100-80g, a100-40g, host."),
    device_memory: Optional[str] = typer.Option(
        None, "--device-memory", help="Total memory of one device (e.g. 64GiB); overrides the "
        "profile's total."),
    host_memory: Optional[str] = typer.Option(
        None, "--host-memory", help="Host RAM available for the host KV pool (HK-07); default: "
        "this machine's MemAvailable."),
    context_len: Optional[int] = typer.Option(
        None, "--context-len", help="Tokens of one request (default: the model's "
        "max_position_embeddings)."),
    workers: Optional[int] = typer.Option(
        None, "--workers", help="Workers (devices) in tensor parallel; default tp_size, or the "
        "number of --devices."),
    execution_peak: Optional[str] = typer.Option(
        None, "--execution-peak", help="Execution peak per worker (e.g. 2GiB) instead of the "
        "default estimate (docs/sizing.md)."),
    runtime_overhead: Optional[str] = typer.Option(
        None, "--runtime-overhead", help="Memory in use before the pool is sized, per worker, "
        "in elastic mode (default 1GiB)."),
    fmt: PlanFormat = typer.Option(PlanFormat.table, "--format", "-f", help="Output format."),
    explain: bool = typer.Option(False, "--explain", help="Print the formula of every figure."),
    config: List[str] = typer.Option([], "--config", help="TOML file (repeatable; later wins)."),
    config_json_file: Optional[str] = typer.Option(
        None, "--config_json_file", help="The engine's JSON config file (overrides flags)."),
    no_env: bool = typer.Option(False, "--no-env", help="Ignore XLLM_VMM_* variables."),
) -> None:
    """Size a configuration before anything is loaded: weights, KV bytes per token/block/page,
    arena, physical budget per mode, host pool, capacity and concurrency at a context length,
    and a verdict. Engine flags are given as --FLAG=VALUE (e.g. --model=Qwen/Qwen3-8B
    --tp_size=2 --enable_vmm_kvcache=true)."""
    if list_models:
        _list_models(fmt)
        return
    from xllm_vmm.config.inputs import resolve_inputs
    from xllm_vmm.config.rules import check
    from xllm_vmm.models import ModelConfigError, load_model_spec
    from xllm_vmm.planner import get_profile, make_plan, parse_bytes
    from xllm_vmm.planner.devices import DeviceError, mem_available
    from xllm_vmm.planner.from_config import inputs_from_config
    from xllm_vmm.planner.report import plan_to_dict, plan_to_toml, render_table
    from xllm_vmm.planner.sizing import Reason

    stray = [a for a in ctx.args if not a.startswith("-")]
    resolved = resolve_inputs(list(ctx.args), config=config, config_json_file=config_json_file,
                              env={} if no_env else os.environ)
    r = resolved[0]
    if r.config is None:
        for f in r.findings:
            typer.echo(f"error: [{f.id}] {f.message}" + (f" ({f.hint})" if f.hint else ""),
                       err=True)
        raise typer.Exit(2)
    cfg = r.config
    try:
        profile = get_profile(device or "ascend-910b-64g")
        total = parse_bytes(device_memory, what="--device-memory") if device_memory else \
            profile.total_bytes
        if total <= 0:
            raise DeviceError(f"--device-memory must be positive, got {device_memory!r}",
                              hint="give the total memory of one device, e.g. 64GiB")
        host = parse_bytes(host_memory, what="--host-memory") if host_memory else mem_available()
        peak = parse_bytes(execution_peak, what="--execution-peak") if execution_peak else None
        overhead = parse_bytes(runtime_overhead, what="--runtime-overhead") \
            if runtime_overhead else None
    except DeviceError as err:
        raise _fail(str(err))
    if context_len is not None and context_len < 1:
        raise _fail(f"--context-len must be at least 1 token, got {context_len}")
    if workers is not None and workers < 1:
        raise _fail(f"--workers must be at least 1, got {workers}")
    ref = str(cfg["model"] or "")
    if not ref:
        if stray:
            raise _fail(f"unexpected argument {stray[0]!r}; give the model as --model={stray[0]}")
        raise _fail("no model given: pass --model=NAME_OR_DIR (a catalogue name such as "
                    "Qwen/Qwen3-8B, see --list-models, or a model directory)")
    try:
        spec = load_model_spec(ref)
    except ModelConfigError as err:
        src = cfg.provenance("model")
        raise _fail(f"{err} [model from {src}]")
    report = check(cfg, spec, device_memory=total, host_memory=host)
    name = device.lower() if device else ("custom" if device_memory else profile.name)
    try:
        inputs = inputs_from_config(
            report.resolved, workers=workers, device_memory_bytes=total, device_name=name,
            host_memory_bytes=host, context_len=context_len, execution_peak_bytes=peak,
            runtime_overhead_bytes=overhead)
        plan = make_plan(spec, inputs)
    except ModelConfigError as err:
        raise _fail(str(err))
    findings = list(r.findings) + list(report.findings)
    if any(x.code == "HK-07" for x in plan.reasons):
        # The plan's HK-07 counts every worker's host pool; keep one message.
        findings = [f for f in findings if f.id != "HK-07"]
    plan.config_findings = [f.to_dict() for f in findings]
    errors = [f for f in findings if f.severity == "error"]
    if errors:
        plan.reasons.insert(0, Reason(
            "error", "CONFIG", f"the configuration has {len(errors)} error(s): "
            + ", ".join(sorted({f.id for f in errors})),
            "fix them (each is listed below); `xllm-vmm check-config --explain ID` explains "
            "a rule"))
    if fmt is PlanFormat.json:
        import json

        typer.echo(json.dumps(plan_to_dict(plan), indent=2))
    elif fmt is PlanFormat.toml:
        typer.echo(plan_to_toml(plan), nl=False)
    else:
        render_table(plan, explain=explain)
    raise typer.Exit(0 if plan.fits else 1)


