"""``xllm-vmm plan``: dry-run sizing of serving configurations.

Takes the same inputs as ``check-config``: ``--FLAG=VALUE`` in gflags syntax, positional TOML
(``.toml``), engine JSON (``.json``) and launch-script files, ``--cmd`` / ``--cmd-file`` launch
commands, ``--config`` TOML files layered under every input, ``--config_json_file``,
``XLLM_VMM_*`` environment variables (:func:`xllm_vmm.config.inputs.resolve_inputs`). Each input
is one configuration: every rule is checked (HK-07 with the plan, :mod:`xllm_vmm.planner.checks`),
then its sizing plan is printed (:mod:`xllm_vmm.planner`). Exit codes, per input and the worst of
them for the run: 0 fits, 1 does not fit (or the configuration has errors), 2 usage error,
unreadable input, unknown model/device, or inputs that cannot be planned (a worker count that
cannot split the heads, a device listed twice, memory above 1 PiB). Nothing here imports torch.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, List, Optional

import typer

from xllm_vmm.cli.root import app


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
                     "weight_dtype": s.weight_dtype, "dtype": s.dtype,
                     "max_position_embeddings": s.max_position_embeddings,
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
    for col in ("name", "layers", "params", "weights", "context", "features"):
        t.add_column(col, justify="right" if col in ("layers", "params", "context") else "left",
                     no_wrap=col == "name")
    for r in rows:
        feats = [f for f, on in (("MLA", r["mla"]), ("hybrid", r["hybrid"]), ("VLM", r["vision"]),
                                 (f"MTP x{r['mtp_layers']}", r["mtp_layers"]),
                                 (f"MoE {r['experts']}", r["experts"])) if on]
        weights = r["weight_dtype"] if r["weight_dtype"] == r["dtype"] else \
            f"{r['weight_dtype']} ({r['dtype']} rest)"
        t.add_row(r["name"], str(r["layers"]), f"{r['params'] / 1e9:,.1f}B", weights,
                  f"{r['max_position_embeddings']:,}", ", ".join(feats))
    # On a terminal the table fits its width; piped or redirected (no terminal: rich would
    # assume 80 columns and cut cells to "bflo…") every value is printed in full.
    Console(width=None if sys.stdout.isatty() else 1000).print(t)


@dataclass
class _Outcome:
    """One input's result: its plan, or why none could be made (exit code 2)."""

    label: str
    code: int
    plan: Any = None
    error: str = ""
    findings: list = field(default_factory=list)


def _plan_one(r, *, device, host, name: str, options: dict) -> _Outcome:
    from xllm_vmm.config.rules import check
    from xllm_vmm.models import ModelConfigError, catalogue_names, load_model_spec
    from xllm_vmm.planner.checks import decide_sizing

    if r.config is None:
        lines = [f"[{f.id}] {f.message}" + (f" ({f.hint})" if f.hint else "") for f in r.findings]
        if r.label.lower() in {n.lower() for n in catalogue_names()}:
            lines.append(f"to size the catalogue model, pass --model={r.label}")
        return _Outcome(r.label, 2, error="; ".join(lines),
                        findings=[f.to_dict() for f in r.findings])
    cfg = r.config
    ref = str(cfg["model"] or "")
    if "model" in cfg.unresolved:
        f = cfg.unresolved["model"]
        return _Outcome(r.label, 2, error=f"the model cannot be sized: {f.message}; pass "
                        "--model=NAME_OR_DIR after the script to size it (direct flags win over "
                        "the script's)")
    if not ref:
        return _Outcome(r.label, 2, error="no model given: pass --model=NAME_OR_DIR (a catalogue "
                        "name such as Qwen/Qwen3-8B, see --list-models, or a model directory)")
    try:
        spec = load_model_spec(ref)
    except ModelConfigError as err:
        return _Outcome(r.label, 2, error=f"{err} [model from {cfg.provenance('model')}]")
    report = check(cfg, spec, device_memory=device.bytes if device else None)
    try:
        checked = decide_sizing(report, cfg, spec, None, device=device, host=host,
                                always_plan=True, device_name=name, **options)
    except ModelConfigError as err:
        # A value that a configuration rule rejects (EL-03, EL-05, HK-08) cannot be sized: the
        # rule's finding is the report, verdict does_not_fit, exit 1 (as any rule error).
        if not any(f.severity == "error" and f.id in _UNPLANNABLE_RULES
                   for f in report.findings):
            return _Outcome(r.label, 2, error=str(err))
        plan = _unsized_plan(spec, report.resolved, device, host, name, options)
        return _finish(r, plan, list(r.findings) + list(report.findings))
    plan = checked.plan
    if plan.layout is None:
        return _Outcome(r.label, 2, error=_layout_error(plan, cfg, options, checked.draft))
    # HK-07 is a configuration finding (the same text as the plan's reason): list it once.
    plan.reasons = [x for x in plan.reasons if x.code != "HK-07"]
    findings = list(r.findings) + list(checked.report.findings)
    # EL-06 is both a configuration rule (with the flag's source) and a plan reason: list it
    # once. With a shared pool (VMM-02) the plan's reason is the exact one (the quota holds the
    # weights too, so its minimum is higher); otherwise the rule's finding says the same with
    # the source of max_cache_size.
    if any(x.code == "EL-06" for x in plan.reasons) and any(f.id == "EL-06" for f in findings):
        if plan.inputs.shared_pool:
            findings = [f for f in findings if f.id != "EL-06"]
        else:
            plan.reasons = [x for x in plan.reasons if x.code != "EL-06"]
    return _finish(r, plan, findings)


#: Rules whose errors leave a value the planner cannot size with (EL-03: max_memory_utilization
#: outside (0, 1] sizing physical KV or fixed VMM; EL-05: a negative max_cache_size or
#: vmm_memory_reserve_bytes; HK-08: a negative host_blocks_factor; CFG-CONFLICT: a dp_size that
#: does not divide the workers).
_UNPLANNABLE_RULES = frozenset({"EL-03", "EL-05", "HK-08", "CFG-CONFLICT"})


def _unsized_plan(spec, cfg, device, host, name: str, options: dict):
    """A plan with no figures (no workers sized): its reasons are the rule errors."""
    from xllm_vmm.planner.from_config import inputs_from_config
    from xllm_vmm.planner.sizing import Plan

    inp = inputs_from_config(cfg, device_memory_bytes=device.bytes if device else None,
                             host_memory_bytes=host.bytes if host else None,
                             host_memory_source=host.source if host else None,
                             device_name=name, **options)
    ctx = inp.context_len if inp.context_len is not None else spec.max_position_embeddings
    return Plan(spec=spec, inputs=inp, layout=None, context_len=ctx or 0)


def _finish(r, plan, findings: list) -> _Outcome:
    """``plan`` with the configuration's findings; a CONFIG error reason when any is an error."""
    from xllm_vmm.planner.sizing import Reason

    plan.config_findings = [f.to_dict() for f in findings]
    errors = [f for f in findings if f.severity == "error"]
    if errors:
        plan.reasons.insert(0, Reason(
            "error", "CONFIG", f"the configuration has {len(errors)} error(s): "
            + ", ".join(sorted({f.id for f in errors})),
            "fix them (each is listed below); `xllm-vmm check-config --explain ID` explains "
            "a rule"))
    return _Outcome(r.label, 0 if plan.fits else 1, plan)


def _layout_error(plan, cfg, options: dict, draft) -> str:
    """The error for a plan whose cache layout cannot be made: the layout's reason, where the
    worker count came from and the worker counts that would work."""
    from xllm_vmm.planner.sizing import valid_worker_counts

    reason = next(x for x in plan.reasons if x.code == "LAYOUT")
    w = plan.inputs.workers
    valid = valid_worker_counts(plan.spec, plan.inputs, draft)
    if w in valid or not valid:
        return f"cannot lay out the KV cache of {plan.spec.name}: {reason.message} " \
               f"({reason.hint})"
    if options.get("workers") is not None:
        src = "--workers"
    else:
        src = (f"nnodes={cfg['nnodes']} (from {cfg.provenance('nnodes')}) x "
               f"devices={cfg['devices'] or 'auto'} (from {cfg.provenance('devices')})")
    tp = plan.inputs.tp
    what = f"{w} workers" if tp == w else f"{w} workers in groups of {tp} (dp_size " \
                                           f"{plan.inputs.dp_size})"
    return (f"{reason.message}: {what} come from {src}; valid tensor-parallel sizes for "
            f"{plan.spec.name}: {', '.join(map(str, valid))}. Set --workers, --nnodes (one "
            "process per device) or --devices to one of them")


def _outcome_dict(o: _Outcome) -> dict:
    from xllm_vmm.planner.report import plan_to_dict

    return {"input": o.label, "exit_code": o.code, "verdict": o.plan.verdict if o.plan else None,
            "error": o.error or None, "input_findings": o.findings,
            "plan": plan_to_dict(o.plan) if o.plan else None}


def _render(outcomes: list[_Outcome], fmt: PlanFormat, explain: bool, code: int) -> None:
    from xllm_vmm.planner.report import drop_none, plan_to_dict, plan_to_toml, render_table
    from xllm_vmm.planner.sizing import SCHEMA_VERSION

    if len(outcomes) == 1:
        o = outcomes[0]
        if o.plan is None:
            typer.echo(f"error: {o.error}", err=True)
        elif fmt is PlanFormat.json:
            import json

            typer.echo(json.dumps(plan_to_dict(o.plan), indent=2))
        elif fmt is PlanFormat.toml:
            typer.echo(plan_to_toml(o.plan), nl=False)
        else:
            render_table(o.plan, explain=explain)
        return
    if fmt is not PlanFormat.table:
        doc = {"schema_version": SCHEMA_VERSION, "tool": "xllm-vmm plan", "exit_code": code,
               "inputs": [_outcome_dict(o) for o in outcomes]}
        if fmt is PlanFormat.json:
            import json

            typer.echo(json.dumps(doc, indent=2))
        else:
            import tomli_w

            typer.echo(tomli_w.dumps(drop_none(doc)), nl=False)
        return
    from rich.console import Console
    from rich.markup import escape

    console = Console(highlight=False)
    for o in outcomes:
        console.rule(f"[bold]{escape(o.label)}[/] (exit {o.code})", align="left")
        if o.plan is None:
            typer.echo(f"error: {o.label}: {o.error}", err=True)
        else:
            render_table(o.plan, explain=explain)
    fits = sum(1 for o in outcomes if o.code == 0)
    console.print(f"{len(outcomes)} input(s): {fits} fit, {len(outcomes) - fits} do not fit or "
                  f"could not be planned → exit {code}")


def _value(flag: str, metavar: str, panel: str, help: str, default=None):
    """A plan option that takes a value, shown in the help panel ``panel``."""
    return typer.Option(default, flag, metavar=metavar, rich_help_panel=panel, help=help)


def _switch(flag: str, panel: str, help: str):
    """A plan on/off option (no value), shown in the help panel ``panel``."""
    return typer.Option(False, flag, metavar="", rich_help_panel=panel, help=help)


_IN = "Inputs"
# Paragraphs as single lines: Typer's rich help keeps the line breaks of a docstring.
_PLAN_HELP = (
    "Size serving configurations before anything is loaded: weights, KV bytes per token, "
    "block and page, the arena, the physical budget of the mode, the host pool, capacity and "
    "concurrency at a context length, and a verdict with what to change.\n\n"
    "Inputs are check-config's: engine flags as --FLAG=VALUE (e.g. --model=Qwen/Qwen3-8B "
    "--nnodes=2 --enable_vmm_kvcache=true), and FILES (.toml, engine .json, launch scripts), "
    "--cmd and --cmd-file, each one configuration with its own report.\n\n"
    "Exit codes: 0 fits, 1 does not fit or has rule errors, 2 unreadable input or unknown "
    "model; with several inputs, the worst.")
_DEV = "Device and host"
_SIZE = "Sizing"
_OUT = "Output"


@app.command(
    "plan",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    options_metavar="[OPTIONS] [FILES]... [--FLAG=VALUE]...",
    help=_PLAN_HELP,
    short_help="Size configurations before anything is loaded: memory per worker, capacity, "
               "concurrency, verdict.",
)
def plan_command(
    ctx: typer.Context,
    config: List[str] = _value(
        "--config", "FILE", _IN, "TOML file layered under every input (repeatable; later "
        "files win).", []),
    config_json_file: Optional[str] = _value(
        "--config_json_file", "FILE", _IN, "The engine's JSON config file; its values override "
        "the command line."),
    cmd: List[str] = _value(
        "--cmd", "'COMMAND'", _IN, "Plan an existing launch command line (repeatable; one "
        "report each).", []),
    cmd_file: List[str] = _value(
        "--cmd-file", "FILE", _IN, "Plan the launch command of a shell script (repeatable; one "
        "report each).", []),
    no_env: bool = _switch("--no-env", _IN, "Ignore XLLM_VMM_* environment variables."),
    device: Optional[str] = _value(
        "--device", "PROFILE", _DEV, "Device profile: ascend-910b-64g (default), "
        "ascend-910b-32g, h200, h100-80g, a100-80g, a100-40g, host."),
    device_memory: Optional[str] = _value(
        "--device-memory", "SIZE", _DEV, "Total memory of one device (e.g. 64GiB); overrides "
        "the profile's total."),
    host_memory: Optional[str] = _value(
        "--host-memory", "SIZE", _DEV, "Host RAM available for the host KV pools of all "
        "workers (HK-07); default: this host's available memory."),
    workers: Optional[int] = _value(
        "--workers", "N", _DEV, "Workers (devices) of the service; default as the engine counts "
        "them: nnodes (processes, one per device) x the devices of one process (--devices), "
        "in dp_size groups of tensor parallel."),
    context_len: Optional[int] = _value(
        "--context-len", "TOKENS", _SIZE, "Tokens of one request (default: the model's "
        "max_position_embeddings)."),
    execution_peak: Optional[str] = _value(
        "--execution-peak", "SIZE", _SIZE, "Execution peak per worker (e.g. 2GiB) instead of "
        "the default estimate (docs/sizing.md)."),
    runtime_overhead: Optional[str] = _value(
        "--runtime-overhead", "SIZE", _SIZE, "Memory in use before the pool is sized, per "
        "worker, in elastic mode (default 1GiB)."),
    fmt: PlanFormat = typer.Option(PlanFormat.table, "--format", "-f", rich_help_panel=_OUT,
                                   help="Output format."),
    explain: bool = _switch("--explain", _OUT, "Print the formula of every figure with its "
                            "numbers."),
    list_models: bool = _switch("--list-models", _OUT, "List the model catalogue and exit."),
) -> None:
    """``xllm-vmm plan``: the help text is :data:`_PLAN_HELP`."""
    if list_models:
        _list_models(fmt)
        return
    from xllm_vmm.config.inputs import resolve_inputs, split_args
    from xllm_vmm.planner import parse_bytes
    from xllm_vmm.planner.checks import device_memory as device_memory_of, host_memory as host_of
    from xllm_vmm.planner.devices import DeviceError

    try:
        dev = device_memory_of(
            parse_bytes(device_memory, what="--device-memory") if device_memory else None,
            device or "ascend-910b-64g")
        host = host_of(parse_bytes(host_memory, what="--host-memory") if host_memory else None)
        peak = parse_bytes(execution_peak, what="--execution-peak") if execution_peak else None
        overhead = parse_bytes(runtime_overhead, what="--runtime-overhead") \
            if runtime_overhead else None
    except DeviceError as err:
        raise _fail(str(err))
    if context_len is not None and context_len < 1:
        raise _fail(f"--context-len must be at least 1 token, got {context_len}")
    if workers is not None and workers < 1:
        raise _fail(f"--workers must be at least 1, got {workers}")
    name = device.lower() if device else ("custom" if device_memory else "ascend-910b-64g")
    flags, files = split_args(ctx.args)
    resolved = resolve_inputs(flags, config=config, config_json_file=config_json_file, cmd=cmd,
                              cmd_file=cmd_file, files=files, env={} if no_env else os.environ)
    options = {"workers": workers, "context_len": context_len, "execution_peak_bytes": peak,
               "runtime_overhead_bytes": overhead}
    outcomes = [_plan_one(r, device=dev, host=host, name=name, options=options)
                for r in resolved]
    code = max(o.code for o in outcomes)
    _render(outcomes, fmt, explain, code)
    raise typer.Exit(code)
