"""A :class:`~xllm_vmm.planner.sizing.Plan` as JSON (versioned schema, see docs/sizing.md),
TOML, or rich tables with a per-worker memory bar."""

from __future__ import annotations

from typing import Any, TextIO

from xllm_vmm.models import LayerKind
from xllm_vmm.planner.sizing import SCHEMA_VERSION, Plan, WorkerPlan


def _worker_dict(w: WorkerPlan, page_bytes: int) -> dict[str, Any]:
    growing = [g for g in w.groups if g.max_tokens_per_seq is None]
    return {
        "index": w.index,
        "device_total_bytes": w.device_total_bytes,
        "weights_bytes": w.weights_bytes,
        "execution_peak_bytes": w.execution_peak_bytes,
        "runtime_overhead_bytes": w.runtime_overhead_bytes,
        "kv_bytes_per_token": sum(g.bytes_per_token for g in growing),
        "block_bytes": {g.name: g.block_bytes for g in w.groups},
        "page_bytes": page_bytes,
        "blocks_per_page": {g.name: g.blocks_per_page for g in w.groups},
        "slot_bytes": {g.name: g.slot_bytes for g in w.groups},
        "groups": [{
            "name": g.name, "tensors": g.tensors,
            "tensor_bytes_per_token": g.tensor_bytes_per_token,
            "bytes_per_token": g.bytes_per_token, "block_bytes": g.block_bytes,
            "tensor_block_bytes": g.tensor_block_bytes, "blocks_per_page": g.blocks_per_page,
            "slot_bytes": g.slot_bytes, "max_tokens_per_seq": g.max_tokens_per_seq,
            "blocks": g.blocks, "units": g.units, "pool_bytes": g.pool_bytes,
        } for g in w.groups],
        "arena_bytes": w.arena_bytes,
        "physical_budget_bytes": w.physical_budget_bytes,
        "kv_pool_bytes": w.kv_pool_bytes,
        "resident_bytes_per_seq": w.resident_bytes_per_seq,
        "resident_slots": w.resident_slots,
        "resident_bytes": w.resident_bytes,
        "mtp_embedding_bytes_per_seq": w.mtp_embedding_bytes_per_seq,
        "mtp_embedding_slots": w.mtp_embedding_slots,
        "mtp_embedding_bytes": w.mtp_embedding_bytes,
        "elastic_min_bytes": w.elastic_min_bytes,
        "elastic_max_bytes": w.elastic_max_bytes,
        "host_pool_bytes": w.host_pool_bytes,
        "kv_capacity_blocks": w.kv_capacity_blocks,
        "kv_capacity_tokens": w.kv_capacity_tokens,
        "max_concurrency": w.max_concurrency,
    }


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """The JSON document (schema ``schema_version`` 1). Field names are stable."""
    spec, inp = plan.spec, plan.inputs
    kinds: dict[str, int] = {}
    for k in LayerKind:
        n = spec.count(k)
        if n:
            kinds[k.value] = n
    per_worker = [_worker_dict(w, inp.page_bytes) for w in plan.workers]
    totals = None
    if plan.workers:
        totals = {
            "weights_bytes": sum(w.weights_bytes for w in plan.workers),
            "arena_bytes": sum(w.arena_bytes for w in plan.workers),
            "physical_budget_bytes": sum(w.physical_budget_bytes for w in plan.workers),
            "host_pool_bytes": sum(w.host_pool_bytes for w in plan.workers),
            "kv_capacity_tokens": plan.worker_min("kv_capacity_tokens"),  # AD-02: minimum
            "max_concurrency": plan.worker_min("max_concurrency"),
        }
    return {
        "schema_version": SCHEMA_VERSION,
        "model": {
            "name": spec.name, "source": spec.source, "architecture": spec.architecture,
            "model_type": spec.model_type, "dtype": spec.dtype, "layers": spec.num_layers,
            "layer_kinds": kinds, "mtp_layers": spec.mtp_layers, "vision": spec.vision,
            "backend": spec.backend, "max_position_embeddings": spec.max_position_embeddings,
            "params": spec.param_count, "weights_bytes": spec.served_weight_bytes,
            "weights_exact": spec.weight_bytes_exact, "quantization": spec.quantization,
            "draft": None if plan.draft is None else {
                "name": plan.draft.name, "source": plan.draft.source,
                "layers": plan.draft.num_layers,
                "weights_bytes": plan.draft.served_weight_bytes,
                "weights_exact": plan.draft.weight_bytes_exact},
        },
        "workers": inp.workers,
        "mode": plan.mode,
        "device": {"name": inp.device_name, "total_bytes": inp.device_memory_bytes,
                   "page_bytes": inp.page_bytes},
        "host_memory_bytes": inp.host_memory_bytes,
        "context_len": plan.context_len,
        "verdict": plan.verdict,
        "serve_refuses": plan.serve_refuses,
        "reasons": [{"severity": r.severity, "code": r.code, "message": r.message,
                     "hint": r.hint} for r in plan.reasons],
        "max_context_len": plan.max_context_len,
        "suggested_workers": plan.suggested_workers,
        "inputs": {
            "block_size": inp.block_size, "kv_cache_dtype": inp.kv_cache_dtype,
            "max_memory_utilization": inp.max_memory_utilization,
            "max_cache_size": inp.max_cache_size,
            "vmm_memory_reserve_bytes": inp.vmm_memory_reserve_bytes,
            "enable_vmm_kvcache": inp.enable_vmm_kvcache,
            "enable_vmm_weights": inp.enable_vmm_weights, "vmm_elastic": inp.vmm_elastic,
            "enable_prefix_cache": inp.enable_prefix_cache,
            "host_blocks_factor": inp.host_blocks_factor,
            "max_seqs_per_batch": inp.max_seqs_per_batch,
            "max_tokens_per_batch": inp.max_tokens_per_batch,
            "enable_chunked_prefill": inp.enable_chunked_prefill,
            "num_speculative_tokens": inp.num_speculative_tokens,
            "speculative_algorithm": inp.speculative_algorithm,
            "execution_peak_bytes": inp.execution_peak_bytes,
            "runtime_overhead_bytes": inp.runtime_overhead_bytes,
        },
        "per_worker": per_worker,
        "totals": totals,
        "formulas": [{"figure": f.figure, "formula": f.formula, "numbers": f.numbers,
                      "value": f.value} for f in plan.formulas],
        "config_findings": list(plan.config_findings),
    }


def drop_none(x: Any) -> Any:
    """``x`` without None values (TOML has no null)."""
    if isinstance(x, dict):
        return {k: drop_none(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [drop_none(v) for v in x]
    return x


def plan_to_toml(plan: Plan) -> str:
    """The JSON document as TOML (null fields left out: TOML has no null)."""
    import tomli_w

    return tomli_w.dumps(drop_none(plan_to_dict(plan)))


def human(n: int | None) -> str:
    """Bytes as GiB/MiB/KiB with two decimals, and the exact count."""
    if n is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,} B"


def _bar(w: WorkerPlan, width: int = 48) -> str:
    total = max(w.device_total_bytes, 1)
    parts = [("W", w.weights_bytes, "magenta"), ("P", w.execution_peak_bytes, "yellow"),
             ("O", w.runtime_overhead_bytes, "red"), ("S", w.resident_bytes, "cyan"),
             ("K", w.kv_pool_bytes, "green")]
    out, used = [], 0
    for ch, nbytes, colour in parts:
        cells = int(round(max(nbytes, 0) / total * width))
        cells = min(cells, width - used)
        used += cells
        if cells:
            out.append(f"[{colour}]{ch * cells}[/]")
    out.append("[dim]" + "." * (width - used) + "[/]")
    return "".join(out)


def render_table(plan: Plan, out: TextIO | None = None, *, explain: bool = False,
                 width: int | None = None) -> None:
    """Rich tables: summary, cache groups, per-worker memory (with a bar), verdict, and with
    ``explain`` every formula with its numbers. ``width``: the console's columns (default: the
    terminal's, or 120 when writing to ``out``); numbers are never cut or wrapped at any
    width from 80 up."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(file=out, highlight=False,
                      width=width if width is not None else (None if out is None else 120))
    spec, inp = plan.spec, plan.inputs
    s = Table(title=f"xllm-vmm plan: {escape(spec.name)}", show_header=False)
    s.add_column("", style="bold")
    s.add_column("")
    s.add_row("mode", plan.mode)
    s.add_row("workers", str(inp.workers))
    s.add_row("device", f"{escape(inp.device_name)}: {human(inp.device_memory_bytes)} "
              f"({inp.device_memory_bytes:,} B), page {human(inp.page_bytes)}")
    s.add_row("model", f"{spec.num_layers} layers, {spec.dtype}, {spec.param_count / 1e9:,.2f}B "
              f"params, weights {human(spec.served_weight_bytes)} "
              f"({'exact' if spec.weight_bytes_exact else 'estimated'})")
    if plan.draft is not None:
        d = plan.draft
        s.add_row("draft model", f"{escape(d.name)}: {d.num_layers} layers, weights "
                  f"{human(d.served_weight_bytes)} "
                  f"({'exact' if d.weight_bytes_exact else 'estimated'})")
    s.add_row("context length", f"{plan.context_len:,} tokens")
    fits = "[green]fits[/]" if plan.fits else "[red]does not fit[/]"
    if plan.fits and plan.serve_refuses:
        fits = (f"[yellow]fits on the device, but serve refuses it "
                f"({', '.join(plan.serve_refuses)}: see below)[/]")
    s.add_row("verdict", fits)
    mcl = "unbounded" if plan.max_context_len is None else f"{plan.max_context_len:,} tokens"
    if not plan.workers:  # not sized: a rule error leaves a value the planner cannot use
        mcl = "not sized (fix the errors below)"
    s.add_row("largest context that fits", mcl)
    console.print(s)
    if plan.workers:
        w0 = plan.workers[0]
        g = Table(title="Cache groups (per worker)")
        # Numbers are never cut or wrapped (no_wrap); headers wrap at spaces and the group name
        # wraps, so the table fits 80 columns.
        for col in ("group", "tensors", "B/token", "block\nbytes", "blocks\nper page",
                    "slot\nbytes", "blocks"):
            if col == "group":
                g.add_column(col, overflow="fold")
            else:
                g.add_column(col, justify="right", no_wrap=True)
        for gp in w0.groups:
            name = gp.name if gp.max_tokens_per_seq is None else \
                f"{gp.name} (<= {gp.max_tokens_per_seq:,} tokens/seq)"
            g.add_row(name, str(gp.tensors), f"{gp.bytes_per_token:,}", f"{gp.block_bytes:,}",
                      f"{gp.blocks_per_page:,}", f"{gp.slot_bytes:,}", f"{gp.blocks:,}")
        console.print(g)
        W = len(plan.workers)
        m = Table(title=f"Memory (per worker; total over {W} worker{'s' if W != 1 else ''})")
        m.add_column("figure")
        m.add_column("per worker", justify="right", no_wrap=True)
        m.add_column("total", justify="right", no_wrap=True)

        def row(label: str, value: int | None, total: bool = True) -> None:
            m.add_row(label, human(value),
                      human(value * W) if (total and value is not None) else "")

        row("weights", w0.weights_bytes)
        row("execution peak", w0.execution_peak_bytes)
        if plan.mode == "elastic_vmm":
            row("runtime overhead", w0.runtime_overhead_bytes)
        row("physical budget", w0.physical_budget_bytes)
        if w0.resident_bytes_per_seq:
            m.add_row("resident state (HY-01)", f"{w0.resident_slots:,} x "
                      f"{human(w0.resident_bytes_per_seq)}", human(w0.resident_bytes * W))
        if w0.mtp_embedding_slots:
            m.add_row("MTP embedding slots (AD-03)", f"{w0.mtp_embedding_slots:,} x "
                      f"{human(w0.mtp_embedding_bytes_per_seq)}",
                      human(w0.mtp_embedding_bytes * W))
        row("KV pool", w0.kv_pool_bytes)
        if plan.mode != "physical":
            row("arena (virtual)", w0.arena_bytes)
        if plan.mode == "elastic_vmm":
            if w0.elastic_max_bytes < w0.elastic_min_bytes:  # not even the least pool fits
                m.add_row("elastic range", f"none (the least pool, "
                          f"{human(w0.elastic_min_bytes)}, does not fit)", "")
            else:
                m.add_row("elastic range", f"{human(w0.elastic_min_bytes)} .. "
                          f"{human(w0.elastic_max_bytes)}", "")
        if w0.host_pool_bytes:
            row("host pool (HK-06)", w0.host_pool_bytes)
        m.add_row("KV capacity", f"{w0.kv_capacity_tokens:,} tokens",
                  f"{plan.worker_min('kv_capacity_tokens'):,} (min, AD-02)")
        m.add_row(f"max concurrency at {plan.context_len:,}", f"{w0.max_concurrency:,}",
                  f"{plan.worker_min('max_concurrency'):,} (min, AD-02)")
        console.print(m)
        for w in plan.workers:
            console.print(f"worker {w.index} |{_bar(w)}| {human(w.device_total_bytes)}")
        console.print("[dim]  [magenta]W[/] weights  [yellow]P[/] execution peak  "
                      "[red]O[/] runtime overhead  [cyan]S[/] resident state[/]\n"
                      "[dim]  [green]K[/] KV pool  . rest[/]")
    for r in plan.reasons:
        colour = {"error": "red", "warning": "yellow"}.get(r.severity, "blue")
        console.print(f"[{colour}]{r.severity}[/] [{escape(r.code)}] {escape(r.message)}"
                      + (f"\n  -> {escape(r.hint)}" if r.hint else ""), soft_wrap=True)
    for f in plan.config_findings:
        colour = "red" if f.get("severity") == "error" else "yellow"
        console.print(f"[{colour}]{f.get('severity')}[/] [{escape(str(f.get('id')))}] "
                      f"{escape(str(f.get('message')))}"
                      + (f"\n  -> {escape(str(f['hint']))}" if f.get("hint") else ""),
                      soft_wrap=True)
    if explain:
        console.print("[bold]Formulas[/]")
        for f in plan.formulas:
            v = f"{f.value:,}" if isinstance(f.value, int) else str(f.value)
            console.print(f"  [bold]{escape(f.figure)}[/]: {escape(f.formula)}\n"
                          f"      {escape(f.numbers)} -> [bold]{v}[/]", soft_wrap=True)
    elif plan.workers:
        console.print("[dim]--explain prints the formula of every figure[/]")
