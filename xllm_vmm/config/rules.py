"""The configuration rules as code (``xllm-vmm check-config --explain RULE-ID`` prints each): one small function per rule id.

:func:`check` runs every rule on a :class:`~xllm_vmm.config.loader.ResolvedConfig` (and the
model's :class:`~xllm_vmm.models.spec.ModelSpec` when it is known) and returns a :class:`Report`:
findings (errors and warnings), implied values (derived, with the rule id), and the rules that
could not be checked and why. It never guesses: a model rule without a model, or a sizing rule
without the memory it needs, is listed in ``Report.not_checked``.

Terms: *KV VMM* ``enable_vmm_kvcache``; *weight VMM* ``enable_vmm_weights``;
*elastic* ``vmm_elastic`` with a VMM pool; *speculative decoding* ``num_speculative_tokens>0``;
*MTP* speculative decoding with ``speculative_algorithm=MTP`` and a ``draft_model``; *external
draft* speculative decoding with another algorithm and a ``draft_model``; *embedded Eagle3 draft*
``speculative_algorithm=Eagle3``; *host offload* KV VMM + prefix cache + ``host_blocks_factor>1``.
Algorithm and transfer-type names compare case-insensitively.

Nothing here imports torch; the model reader is imported only when a model is looked up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

from xllm_vmm.config.catalogue import FLAGS, format_value
from xllm_vmm.config.findings import Finding, HasFindings, Implied
from xllm_vmm.config.loader import ResolvedConfig
from xllm_vmm.config.values import format_size, parse_devices

#: Device kinds with a VMM driver in xllm-vmm.
VMM_DEVICE_KINDS = ("npu", "cuda", "cpu")


@dataclass(frozen=True)
class Rule:
    """One configuration rule. ``kind``: ``config`` (decided from flags), ``model`` (needs the
    model's config.json), ``sizing`` (needs memory sizes), ``runtime`` (enforced while serving)."""

    id: str
    severity: str  # error / warning / implied / runtime
    kind: str
    condition: str
    outcome: str
    source: str  # the specification sentence it comes from


def _r(id, severity, kind, condition, outcome, source):
    return Rule(id, severity, kind, condition, outcome, source)


RULES: dict[str, Rule] = {r.id: r for r in [
    _r("VMM-01", "error", "config", "KV VMM or weight VMM on a device kind without a VMM driver",
       "refused; the supported kinds are npu, cuda and cpu",
       '000 "Both options default to false and are supported on NPU."; 001 "仅 NPU 支持"'),
    _r("VMM-02", "implied", "config", "KV VMM and weight VMM both on",
       "one VMM pool shared by the KV cache and the weights",
       '000 "enable both to share the VMM pool between the KV Cache and model weights"'),
    _r("VMM-03", "implied", "config", "weight VMM on, KV VMM off",
       "the KV cache uses the physical (non-VMM) implementation",
       '000 "Weight-only VMM keeps the physical KV Cache implementation."'),
    _r("VMM-04", "implied", "config", "weight VMM on",
       "enable_manual_loader=true; an explicit enable_manual_loader=false is a warning and is overridden",
       '001 "为模型权重使用 VMM，并隐式启用 manual loader"'),
    _r("VMM-05", "implied", "config", "KV VMM on, weight VMM off",
       "the configured weight loader is kept; enable_manual_loader is not changed",
       '001 "仅启用 KV VMM 时继续使用配置的权重加载器，不会隐式启用 enable_manual_loader"'),
    _r("VMM-06", "warning", "config",
       "vmm_elastic=true, vmm_memory_reserve_bytes>0, or max_cache_size>0 meant for the pool, "
       "with neither VMM flag on", "the VMM-only settings have no effect", "derived"),
    _r("W-01", "error", "model", "weight VMM with a backend other than llm (inferred from the "
       "model when backend is empty)", "refused",
       '000 "Weight VMM currently supports the LLM backend."'),
    _r("W-02", "runtime", "runtime", "sleep, wakeup or fork of a model without weight VMM",
       "refused with an error naming enable_vmm_weights",
       '000 "Model sleep, wakeup and fork require enable_vmm_weights=true."'),
    _r("W-03", "error", "config", "weight VMM on, KV VMM off, vmm_elastic=false",
       "refused: weight-only VMM needs vmm_elastic=true",
       '000 "Weight-only VMM requires vmm_elastic=true; a fixed weight pool would consume memory '
       'needed by the physical KV Cache."'),
    _r("W-04", "error", "model", "weight VMM with a hybrid model (linear-state caches)", "refused",
       '000 "Hybrid linear-state caches and external draft models do not support weight VMM."'),
    _r("W-05", "error", "config", "weight VMM with an external draft", "refused",
       '000 "Hybrid linear-state caches and external draft models do not support weight VMM."'),
    _r("W-06", "runtime", "runtime", "remote weight transfer using Mooncake while the pool is elastic",
       "refused: needs vmm_elastic=false and a positive max_memory_utilization",
       '000 "PD KV transfer and remote weight transfer using Mooncake require a fully resident '
       'pool; use vmm_elastic=false and a positive max_memory_utilization."'),
    _r("PC-01", "implied", "config", "KV VMM and enable_prefix_cache=true",
       "complete KV blocks are reused across requests; cached blocks keep their virtual addresses "
       "and physical pages after the request ends",
       '000 "Set enable_prefix_cache=true together with enable_vmm_kvcache=true to reuse complete '
       'KV blocks across requests. Cached blocks retain their virtual addresses and physical pages '
       'after a request completes."'),
    _r("PC-02", "implied", "model", "PC-01 with a hybrid model",
       "a prefix hit is only usable where a recoverable linear-state checkpoint exists",
       '000 "hybrid attention also requires a recoverable linear-state checkpoint"'),
    _r("PC-03", "warning", "config",
       "PC-01 with cache-aware routing (enable_service_routing=true)",
       "KV cache events are not published for VMM blocks",
       '000 "This option does not enable KV Cache event publishing for VMM."'),
    _r("HK-01", "implied", "config", "KV VMM, enable_prefix_cache=true, host_blocks_factor>1",
       "completed blocks are retained in host memory and restored into newly mapped VMM blocks",
       '000 "Enable prefix caching and set host_blocks_factor greater than 1 to retain completed KV '
       'blocks in host memory."'),
    _r("HK-02", "warning", "config", "host_blocks_factor>1 with enable_prefix_cache=false",
       "no host retention happens",
       '000 "Enable prefix caching and set host_blocks_factor greater than 1"'),
    _r("HK-03", "warning", "config", "0 < host_blocks_factor <= 1",
       "host retention is off (it needs a factor above 1)",
       '000 "set host_blocks_factor greater than 1"'),
    _r("HK-04", "error", "config", "host offload with kv_cache_dtype other than auto", "refused",
       '000 "This LLM path supports flat KV and MLA+INDEX tensor layouts with kv_cache_dtype=auto"'),
    _r("HK-05", "error", "model",
       "host offload with a VLM backend, grouped KV caches, or a hybrid model's conv/SSM caches",
       "refused",
       '000 "VLM, grouped caches, and hybrid linear-attention conv/SSM caches remain unsupported '
       'for VMM HostKV offload."'),
    _r("HK-06", "implied", "config", "host offload",
       "host capacity = configured device KV tensor capacity × host_blocks_factor, preallocated, "
       "also in elastic mode",
       '000 "Host capacity is preallocated from the configured device KV tensor capacity '
       'multiplied by host_blocks_factor, including in elastic mode."'),
    _r("HK-07", "warning", "sizing",
       "the preallocated host capacity (HK-06) exceeds the host's available RAM",
       "error when serving; warning in check-config and plan, with the numbers",
       '000 "Size max_cache_size and the factor for available host RAM."'),
    _r("HK-08", "error", "config", "host_blocks_factor < 0", "refused", "derived"),
    _r("SD-01", "implied", "config", "MTP with KV VMM",
       "target and draft KV caches are mapped and released together, also when their KV widths differ",
       '000 "The scheduler maps and releases both caches together, including models whose target '
       'and draft KV tensors have different widths."'),
    _r("SD-02", "error", "config", "embedded Eagle3 draft with KV VMM", "refused",
       '000 "Embedded Eagle3 drafts and speculative decoding with PD disaggregation are '
       'unsupported with virtual KV Cache."'),
    _r("SD-03", "error", "config",
       "speculative decoding with PD disaggregation (enable_disagg_pd=true) and KV VMM", "refused",
       '000 "Embedded Eagle3 drafts and speculative decoding with PD disaggregation are '
       'unsupported with virtual KV Cache."'),
    _r("SD-04", "error", "config", "KV VMM with enable_task_pipeline=true", "refused",
       '001 "请设置 enable_task_pipeline=false；当前任务执行流水线尚不支持虚拟 KV Cache。"'),
    _r("SD-05", "error", "config",
       "num_speculative_tokens>0 with speculative_algorithm=MTP and no draft_model",
       "refused: MTP needs the draft model path", "derived from the MTP launch example "
       '(000 "--draft_model=/models/mtp --speculative_algorithm=MTP --num_speculative_tokens=3")'),
    _r("HY-01", "implied", "model", "KV VMM with a hybrid model",
       "only full-attention KV tensors use VMM; conv and recurrent states stay resident and are "
       "reserved separately from the physical KV page pool",
       '000 "For hybrid attention models, only full-attention KV tensors use VMM; convolution and '
       'recurrent states remain resident and are reserved separately from the physical KV page pool."'),
    _r("QK-01", "error", "config", "KV VMM with kv_cache_dtype other than auto",
       "refused: quantized KV cache is unsupported with KV VMM",
       '000 "Quantized KV Cache remains unsupported with KV VMM."'),
    _r("EL-01", "implied", "config", "KV VMM and elastic",
       "physical backing grows as KV pages are mapped; idle backing is released after the last "
       "block on a page is returned; a stable virtual arena is reserved and logical slots are "
       "activated on demand",
       '000 "With enable_vmm_kvcache=true and vmm_elastic=true, physical backing grows as KV pages '
       'are mapped."'),
    _r("EL-02", "warning", "config",
       "elastic and max_memory_utilization set explicitly (command line, file or environment)",
       "it has no effect in this mode; max_cache_size is the byte quota",
       '000 "An existing setting such as max_memory_utilization=0.75 has no effect in this mode."'),
    _r("EL-03", "error", "config",
       "not elastic (physical KV or fixed VMM) and max_memory_utilization not in (0, 1]",
       "refused", '000 "Physical KV Cache and fixed VMM continue to use the ratio."'),
    _r("EL-04", "error", "config", "elastic and max_memory_utilization outside [0, 1]",
       "refused (the value is ignored, but must still be a ratio)", "derived"),
    _r("EL-05", "error", "config", "max_cache_size < 0 or vmm_memory_reserve_bytes < 0",
       "refused", "derived"),
    _r("EL-06", "error", "model",
       "max_cache_size>0 smaller than one page for every VMM tensor (the least the pool can map)",
       "refused with the minimum", "derived"),
    _r("EL-07", "implied", "config", "elastic",
       "growth and admission use current free memory minus the observed execution peak minus "
       "vmm_memory_reserve_bytes; with a reserve of 0 the observed execution headroom is still kept",
       '000 "Actual growth and request admission use current free memory and preserve headroom '
       'for observed execution peaks plus vmm_memory_reserve_bytes."'),
    _r("EL-08", "warning", "sizing",
       "vmm_memory_reserve_bytes larger than the device's total memory", "the pool could never grow",
       "derived"),
    _r("PD-01", "error", "config",
       "PD disaggregation with KV transfer over Mooncake (kv_cache_transfer_type=Mooncake) and "
       "KV VMM elastic", "refused: needs vmm_elastic=false and a positive max_memory_utilization",
       '000 "PD KV transfer and remote weight transfer using Mooncake require a fully resident '
       'pool; use vmm_elastic=false and a positive max_memory_utilization."'),
    _r("AD-01", "runtime", "runtime", "admission",
       "request token demand is converted into KV blocks with the model's actual cache layout, "
       "per cache group", '000 "Admission converts request token demand into KV blocks using the '
       'model\'s actual cache layout"'),
    _r("AD-02", "runtime", "runtime", "admission",
       "the capacity used is the minimum available across the model's workers",
       '000 "and the minimum available capacity across its workers"'),
    _r("AD-03", "runtime", "runtime", "admission",
       "MTP embedding slots and hybrid recurrent-state slots must be available too",
       '000 "MTP embedding slots and hybrid recurrent-state slots must also be available."'),
    _r("AD-04", "runtime", "runtime", "admission",
       "a fresh chunked-prefill request is checked against its full prompt footprint; decode takes "
       "more blocks as tokens are generated; no request's maximum output is reserved in advance",
       '000 "Fresh chunked-prefill requests are checked against their full prompt footprint"'),
    _r("AD-05", "runtime", "runtime", "admission",
       "running concurrency adapts to request lengths and live memory, within max_seqs_per_batch "
       "and max_tokens_per_batch",
       '000 "Running concurrency therefore adapts to request lengths and live memory within the '
       'configured scheduler limits."'),
]}


@dataclass
class Report(HasFindings):
    """The outcome of :func:`check`.

    ``findings``: errors and warnings, each with rule id, flags (name → value) and sources
    (name → :class:`Source`). ``implied``: values set by implied rules. ``resolved``: the
    configuration with implied flag values applied (provenance ``derived``, with the rule id).
    ``not_checked``: ``{rule id: reason}`` for rules that apply but could not be decided.
    """

    resolved: ResolvedConfig
    findings: list[Finding] = field(default_factory=list)
    implied: list[Implied] = field(default_factory=list)
    not_checked: dict[str, str] = field(default_factory=dict)
    model: str | None = None  # the model the model rules were checked against

    def exit_code(self, strict: bool = False) -> int:
        """0 valid, 1 errors (or warnings with ``strict``)."""
        return 1 if self.errors or (strict and self.warnings) else 0

    def rule_ids(self) -> list[str]:
        return [f.id for f in self.findings]


class _Ctx:
    def __init__(self, cfg: ResolvedConfig, model, model_reason: str | None,
                 device_memory: int | None):
        self.cfg = cfg
        self.model = model
        self.model_reason = model_reason or (
            "no --model given" if not cfg["model"] else f"the model {cfg['model']!r} was not read")
        self.device_memory = device_memory
        c = cfg
        self.kv = bool(c["enable_vmm_kvcache"])
        self.w = bool(c["enable_vmm_weights"])
        self.vmm = self.kv or self.w
        self.elastic = self.vmm and bool(c["vmm_elastic"])
        self.kv_elastic = self.kv and bool(c["vmm_elastic"])
        self.spec = c["num_speculative_tokens"] > 0
        alg = str(c["speculative_algorithm"]).strip().lower()
        self.mtp = self.spec and alg == "mtp" and bool(c["draft_model"])
        self.eagle3 = alg == "eagle3"
        self.external_draft = self.spec and alg != "mtp" and bool(c["draft_model"])
        self.prefix = bool(c["enable_prefix_cache"])
        self.host_offload = self.kv and self.prefix and c["host_blocks_factor"] > 1

    # helpers
    def d(self, *names: str) -> str:
        return ", ".join(self.cfg.describe(n) for n in names)

    def finding(self, rule_id: str, message: str, names: tuple[str, ...], hint: str,
                severity: str | None = None) -> Finding:
        """A finding of ``rule_id`` (its message prefixed with the id) naming ``names`` with
        their values and provenance."""
        rule = RULES[rule_id]
        sev = severity or ("error" if rule.severity == "error" else "warning")
        return Finding(rule_id, sev, f"{rule_id}: {message}",
                       flags={n: self.cfg[n] for n in names},
                       sources={n: self.cfg.provenance(n) for n in names}, hint=hint,
                       input=self.cfg.label)


_Out = Iterator["Finding | Implied | tuple[str, str]"]  # tuple: (rule id, not-checked reason)
_CHECKS: list[tuple[str, Callable[[_Ctx], _Out]]] = []


def _rule(*ids: str):
    def deco(fn):
        for i in ids:
            assert i in RULES, i
        _CHECKS.append((ids[0], fn))
        return fn
    return deco


#: The not-checked reason of a sizing rule that applies until the planner decides it.
SIZING_PENDING = ("needs the sizing plan: the model, the device memory and the host memory "
                  "(check-config decides it when all three are known; `xllm-vmm plan` always)")


def _not_checked(rule_id: str, reason: str) -> tuple[str, str]:
    return (rule_id, reason)


def _model_rule(rule_id: str, applies: Callable[[_Ctx], bool]):
    """A model rule: when ``applies(x)``, the decorated ``fn(x, model)`` runs with the model,
    or the rule is listed as not checked (with why the model is unknown)."""
    def deco(fn: Callable[[_Ctx, object], _Out]):
        def run(x: _Ctx) -> _Out:
            if not applies(x):
                return
            if x.model is None:
                yield _not_checked(rule_id, x.model_reason)
                return
            yield from fn(x, x.model)
        _rule(rule_id)(run)
        return fn
    return deco


def _flag_rule(rule_id: str, applies: Callable[[_Ctx], bool], names: tuple[str, ...],
               message: str, hint: str) -> None:
    """A rule decided by flags alone: when ``applies(x)``, a finding ``message`` followed by
    the flags ``names`` with their values and sources."""
    def run(x: _Ctx) -> _Out:
        if applies(x):
            yield x.finding(rule_id, f"{message} ({x.d(*names)})", names, hint)
    _rule(rule_id)(run)


# ----------------------------------------------------------------------------- enabling VMM


@_rule("VMM-01")
def _vmm01(x: _Ctx) -> _Out:
    # The devices list is checked with or without VMM (a bad entry, a device listed twice).
    try:
        devices = parse_devices(x.cfg["devices"])
    except ValueError as err:
        yield Finding("CFG-TYPE", "error", f"devices: {err} ({x.cfg.provenance('devices')})",
                      flags={"devices": x.cfg["devices"]},
                      sources={"devices": x.cfg.provenance("devices")},
                      hint="write devices as npu:0,npu:1 / cuda:0 / cpu / auto, each device "
                           "once",
                      where=x.cfg.provenance("devices"), input=x.cfg.label)
        return
    from xllm_vmm.config.parallel import parallel_of, parallel_problems

    conflicts = set()  # flags the engine itself refuses: no CFG-SERVE on top of CFG-CONFLICT
    for severity, message, names, hint in parallel_problems(x.cfg, parallel_of(x.cfg)):
        if severity == "error":
            conflicts.add(names[0])
        srcs = {n: x.cfg.provenance(n) for n in names}
        shown = ", ".join(f"{n}={x.cfg[n] if x.cfg[n] != '' else 'auto'} ({srcs[n]})"
                          for n in names)
        yield Finding("CFG-CONFLICT" if severity == "error" else "CFG-IGNORED", severity,
                      f"{message} [{shown}]", flags={n: x.cfg[n] for n in names}, sources=srcs,
                      hint=hint, where=srcs[names[0]], input=x.cfg.label)
    from xllm_vmm.config.parallel import SERVE_REFUSES_ID, serve_refusals

    for name, message, hint in serve_refusals(x.cfg):
        if name in conflicts:
            continue
        src = x.cfg.provenance(name)
        yield Finding(SERVE_REFUSES_ID, "warning",
                      f"{message} [{name}={x.cfg[name]} ({src})]; the engine itself runs it: "
                      "a finding about xllm-vmm serve only",
                      flags={name: x.cfg[name]}, sources={name: src}, hint=hint, where=src,
                      input=x.cfg.label)
    yield from _ranks(x)
    yield from _split(x)
    if not x.vmm:
        return
    bad = sorted({k for k, _ in devices if k not in VMM_DEVICE_KINDS})
    if bad:
        on = [n for n in ("enable_vmm_kvcache", "enable_vmm_weights") if x.cfg[n]]
        yield x.finding(
            "VMM-01", f"{x.d(*on)} needs a device kind with a VMM driver, but "
            f"{x.d('devices')} uses {', '.join(bad)}",
            ("devices", *on),
            f"serve on {', '.join(VMM_DEVICE_KINDS)} devices, or turn VMM off "
            f"({' '.join('--' + n + '=false' for n in on)})")


def _split(x: _Ctx) -> _Out:
    """The model's heads split over the tensor-parallel workers (``nnodes × devices /
    dp_size``): a count that cannot split them is refused (the engine cannot shard the model;
    ``plan`` exits 2 on it)."""
    if x.model is None:
        return
    from xllm_vmm.config.parallel import parallel_of
    from xllm_vmm.models import LayoutError, cache_layout

    try:
        p = parallel_of(x.cfg)
    except ValueError:  # a bad devices list: reported above
        return
    try:
        cache_layout(x.model, workers=p.tp, block_size=max(1, int(x.cfg["block_size"])))
    except LayoutError as err:
        names = ("nnodes", "devices", "dp_size")
        srcs = {n: x.cfg.provenance(n) for n in names}
        yield Finding("CFG-CONFLICT", "error",
                      f"{err.message} ({p.describe()}; "
                      + ", ".join(f"{n}={x.cfg[n] or 'auto'} ({srcs[n]})" for n in names) + ")",
                      flags={n: x.cfg[n] for n in names}, sources=srcs, hint=err.hint,
                      where=srcs["nnodes"], input=x.cfg.label)


def _ranks(x: _Ctx) -> _Out:
    """``node_rank`` must be one of the service's ``nnodes`` processes (0..nnodes-1): the
    engine gives process ``node_rank`` the global ranks from ``node_rank × len(devices)``, so a
    rank past the last process names workers that do not exist."""
    rank, nnodes = int(x.cfg["node_rank"]), int(x.cfg["nnodes"])
    if rank >= nnodes:
        srcs = {"node_rank": x.cfg.provenance("node_rank"), "nnodes": x.cfg.provenance("nnodes")}
        yield Finding("CFG-CONFLICT", "error",
                      f"node_rank={rank} ({srcs['node_rank']}) but nnodes={nnodes} "
                      f"({srcs['nnodes']}): the ranks of a service are 0..{nnodes - 1} (nnodes is "
                      f"the total number of processes, one per device, across every machine)",
                      flags={"node_rank": rank, "nnodes": nnodes}, sources=srcs,
                      hint=f"set nnodes to the total number of processes (at least {rank + 1}), "
                           f"or node_rank below {nnodes}",
                      where=srcs["node_rank"], input=x.cfg.label)


@_rule("VMM-02", "VMM-03", "VMM-04", "VMM-05")
def _vmm_impl(x: _Ctx) -> _Out:
    if x.kv and x.w:
        yield Implied("VMM-02", "vmm_pool", "shared",
                      "one VMM pool is shared by the KV cache and the weights")
    if x.w and not x.kv:
        yield Implied("VMM-03", "kv_cache_impl", "physical",
                      "weight-only VMM: the KV cache uses the physical implementation")
    if x.w:
        loader = x.cfg.provenance("enable_manual_loader")
        if x.cfg.explicit("enable_manual_loader") and not x.cfg["enable_manual_loader"]:
            yield x.finding(
                "VMM-04", f"{x.d('enable_manual_loader')} is overridden: "
                f"{x.d('enable_vmm_weights')} always uses the manual loader",
                ("enable_manual_loader", "enable_vmm_weights"),
                "remove enable_manual_loader=false", severity="warning")
        if not (x.cfg["enable_manual_loader"] and loader.kind != "default"):
            yield Implied("VMM-04", "enable_manual_loader", True,
                          "weight VMM loads weights with the manual loader")
    if x.kv and not x.w:
        yield Implied("VMM-05", "weight_loader",
                      "manual" if x.cfg["enable_manual_loader"] else "default",
                      "KV-only VMM keeps the configured weight loader "
                      f"(enable_manual_loader={format_value(FLAGS['enable_manual_loader'], x.cfg['enable_manual_loader'])})")


@_rule("VMM-06")
def _vmm06(x: _Ctx) -> _Out:
    if x.vmm:
        return
    names = [n for n in ("vmm_elastic", "vmm_memory_reserve_bytes")
             if x.cfg[n] and x.cfg[n] > 0]
    if not names:
        return
    note = ""
    if x.cfg["max_cache_size"] > 0 and x.cfg.explicit("max_cache_size"):
        names.append("max_cache_size")
        note = "; max_cache_size then limits the physical KV cache, not a VMM pool"
    yield x.finding(
        "VMM-06", f"{x.d(*names)} has no effect: neither enable_vmm_kvcache nor "
        f"enable_vmm_weights is on{note}", tuple(names),
        "turn on --enable_vmm_kvcache=true (or --enable_vmm_weights=true), or remove "
        + ", ".join(n for n in names if n != "max_cache_size"))


# ----------------------------------------------------------------------------- weights


def _backend(x: _Ctx) -> tuple[str | None, str]:
    """(backend, how it was found); backend None when it cannot be known."""
    if x.cfg["backend"]:
        return str(x.cfg["backend"]).strip().lower(), str(x.cfg.provenance("backend"))
    if x.model is not None:
        return x.model.backend, f"inferred from the model {x.model.name}"
    return None, ""


@_rule("W-01")
def _w01(x: _Ctx) -> _Out:
    if not x.w:
        return
    backend, how = _backend(x)
    if backend is None:
        yield _not_checked("W-01", f"backend is empty and {x.model_reason}: the backend cannot "
                                   "be inferred")
        return
    if backend != "llm":
        yield x.finding(
            "W-01", f"{x.d('enable_vmm_weights')} supports only the llm backend, but the "
            f"backend is {backend} ({how})", ("enable_vmm_weights", "backend"),
            "turn weight VMM off (--enable_vmm_weights=false); KV VMM alone "
            "(--enable_vmm_kvcache=true) works with other backends")


@_rule("W-03")
def _w03(x: _Ctx) -> _Out:
    if x.w and not x.kv and not x.cfg["vmm_elastic"]:
        yield x.finding(
            "W-03", f"weight-only VMM ({x.d('enable_vmm_weights', 'enable_vmm_kvcache')}) "
            f"needs an elastic pool, but {x.d('vmm_elastic')}: a fixed weight pool would take "
            "memory the physical KV cache needs",
            ("enable_vmm_weights", "enable_vmm_kvcache", "vmm_elastic"),
            "add --vmm_elastic=true, or also enable --enable_vmm_kvcache=true")


@_model_rule("W-04", lambda x: x.w)
def _w04(x: _Ctx, model) -> _Out:
    if model.is_hybrid:
        yield x.finding(
            "W-04", f"{x.d('enable_vmm_weights')} is not supported for the hybrid model "
            f"{model.name} (linear-attention / SSM layers)", ("enable_vmm_weights", "model"),
            "turn weight VMM off (--enable_vmm_weights=false)")


@_rule("W-05")
def _w05(x: _Ctx) -> _Out:
    if x.w and x.external_draft:
        names = ("enable_vmm_weights", "speculative_algorithm", "draft_model",
                 "num_speculative_tokens")
        yield x.finding(
            "W-05", f"{x.d('enable_vmm_weights')} is not supported with an external draft "
            f"model ({x.d(*names[1:])})", names,
            "turn weight VMM off (--enable_vmm_weights=false), or use MTP")


# ----------------------------------------------------------------------------- prefix cache


@_rule("PC-01", "PC-02", "PC-03")
def _pc(x: _Ctx) -> _Out:
    if not (x.kv and x.prefix):
        return
    yield Implied("PC-01", "prefix_cache", "vmm_blocks",
                  "complete KV blocks are reused across requests; cached blocks keep their "
                  "virtual addresses and physical pages until evicted (LRU)")
    if x.model is None:
        yield _not_checked("PC-02", x.model_reason)
    elif x.model.is_hybrid:
        yield Implied("PC-02", "prefix_cache_hybrid", "needs_linear_state_checkpoint",
                      "a prefix hit is usable only where a recoverable linear-state checkpoint "
                      "exists")
    if x.cfg["enable_service_routing"]:
        yield x.finding(
            "PC-03", f"{x.d('enable_service_routing')} expects KV cache events, but they "
            f"are not published for VMM blocks ({x.d('enable_vmm_kvcache', 'enable_prefix_cache')})",
            ("enable_service_routing", "enable_vmm_kvcache", "enable_prefix_cache"),
            "route without cache events, or use the physical KV cache for cache-aware routing")


# ----------------------------------------------------------------------------- host KV offload


@_rule("HK-01", "HK-02", "HK-03", "HK-04", "HK-06", "HK-08")
def _hk(x: _Ctx) -> _Out:
    f = x.cfg["host_blocks_factor"]
    if f < 0:
        yield x.finding("HK-08", f"{x.d('host_blocks_factor')} is negative",
                        ("host_blocks_factor",),
                        "set host_blocks_factor to 0 (off) or above 1 (host tier on)")
        return
    if 0 < f <= 1:
        yield x.finding(
            "HK-03", f"{x.d('host_blocks_factor')} keeps no blocks in host memory: host "
            "retention needs a factor above 1", ("host_blocks_factor",),
            "set host_blocks_factor above 1 (e.g. 2) to retain blocks, or 0 to say it is off")
    if f > 1 and not x.prefix:
        yield x.finding(
            "HK-02", f"{x.d('host_blocks_factor')} has no effect with "
            f"{x.d('enable_prefix_cache')}: no blocks are retained in host memory",
            ("host_blocks_factor", "enable_prefix_cache"),
            "add --enable_prefix_cache=true, or remove host_blocks_factor")
    if not x.host_offload:
        return
    yield Implied("HK-01", "host_kv_offload", True,
                  "completed blocks are retained in host memory and restored into newly mapped "
                  "VMM blocks")
    if x.cfg["kv_cache_dtype"] != "auto":
        yield x.finding(
            "HK-04", f"host KV offload ({x.d('host_blocks_factor')}) needs "
            f"kv_cache_dtype=auto, but {x.d('kv_cache_dtype')}",
            ("host_blocks_factor", "kv_cache_dtype"),
            "set --kv_cache_dtype=auto, or turn host offload off (--host_blocks_factor=0)")
    quota = x.cfg["max_cache_size"]
    if quota > 0:
        value = int(quota * f)
        text = (f"{format_size(value)} of host memory ({value} bytes = max_cache_size "
                f"{quota} × host_blocks_factor {f}), preallocated")
    else:
        value = f"device KV capacity × {f}"
        text = (f"host memory = the device KV tensor capacity × {f}, preallocated at start-up "
                "(also in elastic mode)")
    yield Implied("HK-06", "host_kv_capacity", value, text)


@_rule("HK-05")
def _hk05(x: _Ctx) -> _Out:
    # One criterion for check-config, plan and serving: xllm_vmm.kvcache.host_support (what the
    # host tier can copy, decided on the model's cache layout).
    if not x.host_offload:
        return
    backend, how = _backend(x)
    reason = None
    if backend == "vlm":
        reason = f"the vlm backend ({how}): VLM backends are unsupported"
    elif x.model is not None:
        from xllm_vmm.kvcache.host_support import host_tier_unsupported_reason
        from xllm_vmm.models import LayoutError, cache_layout

        try:
            layout = cache_layout(x.model, workers=_tp(x), block_size=int(x.cfg["block_size"]),
                                  kv_dtype=str(x.cfg["kv_cache_dtype"]), draft=x.mtp)
        except LayoutError as err:  # the layout error itself is the planner's to report
            yield _not_checked("HK-05", f"the cache layout cannot be computed: {err}")
            return
        why = host_tier_unsupported_reason(layout)
        if why is not None:
            reason = f"{x.model.name}: {why.replace(' (HK-05)', '')}"
    if reason is not None:
        yield x.finding(
            "HK-05", f"host KV offload ({x.d('host_blocks_factor')}) is refused for "
            + reason, ("host_blocks_factor", "enable_vmm_kvcache", "model"),
            "turn host offload off (--host_blocks_factor=0)")
    elif x.model is None:
        yield _not_checked("HK-05", x.model_reason)


@_rule("HK-07")
def _hk07(x: _Ctx) -> _Out:
    # Decided by the sizing plan (xllm_vmm.planner.checks.check_sizing): it needs the model, the
    # device memory and the host memory. Here it is only marked as applying.
    if x.host_offload:
        yield _not_checked("HK-07", SIZING_PENDING)


# ----------------------------------------------------------------------------- speculative, hybrid


@_rule("SD-01")
def _sd01(x: _Ctx) -> _Out:
    if x.kv and x.mtp:
        yield Implied("SD-01", "draft_kv_cache", "mapped_with_target",
                      "target and MTP draft KV caches are mapped and released together")


@_rule("SD-02")
def _sd02(x: _Ctx) -> _Out:
    if x.kv and x.eagle3:
        yield x.finding(
            "SD-02", f"an embedded Eagle3 draft ({x.d('speculative_algorithm')}) is not "
            f"supported with {x.d('enable_vmm_kvcache')}",
            ("speculative_algorithm", "enable_vmm_kvcache"),
            "turn KV VMM off (--enable_vmm_kvcache=false) or use another algorithm (e.g. MTP)")


_flag_rule("SD-03", lambda x: x.kv and x.spec and x.cfg["enable_disagg_pd"],
           ("num_speculative_tokens", "enable_disagg_pd", "enable_vmm_kvcache"),
           "speculative decoding with PD disaggregation is not supported with virtual KV cache",
           "set --num_speculative_tokens=0, or --enable_vmm_kvcache=false")
_flag_rule("SD-04", lambda x: x.kv and x.cfg["enable_task_pipeline"],
           ("enable_task_pipeline", "enable_vmm_kvcache"),
           "the task pipeline does not support virtual KV cache",
           "set --enable_task_pipeline=false (or --noenable_task_pipeline)")
_flag_rule("SD-05", lambda x: x.spec and not x.cfg["draft_model"]
           and str(x.cfg["speculative_algorithm"]).strip().lower() == "mtp",
           ("num_speculative_tokens", "speculative_algorithm", "draft_model"),
           "MTP speculative decoding needs the draft model path",
           "add --draft_model=/path/to/mtp, or set --num_speculative_tokens=0")


@_model_rule("HY-01", lambda x: x.kv)
def _hy01(x: _Ctx, model) -> _Out:
    if model.is_hybrid:
        yield Implied("HY-01", "linear_state", "resident",
                      "only full-attention KV tensors use VMM; conv and recurrent states stay "
                      "resident, reserved outside the KV page pool")


_flag_rule("QK-01", lambda x: x.kv and x.cfg["kv_cache_dtype"] != "auto",
           ("kv_cache_dtype", "enable_vmm_kvcache"),
           "quantized KV cache is not supported with KV VMM",
           "set --kv_cache_dtype=auto, or --enable_vmm_kvcache=false")


# ----------------------------------------------------------------------------- elastic, budget


@_rule("EL-01", "EL-07")
def _el_implied(x: _Ctx) -> _Out:
    if x.kv_elastic:
        yield Implied("EL-01", "vmm_growth", "elastic",
                      "physical pages are mapped as KV blocks are needed and released when idle; "
                      "a stable virtual arena is reserved")
    if x.elastic:
        r = x.cfg["vmm_memory_reserve_bytes"]
        yield Implied("EL-07", "growth_budget",
                      f"free - execution_peak - {r}",
                      f"growth and admission use free memory minus the observed execution peak "
                      f"minus vmm_memory_reserve_bytes ({format_size(r) if r > 0 else '0'})")


@_rule("EL-02", "EL-03", "EL-04")
def _el_ratio(x: _Ctx) -> _Out:
    u = x.cfg["max_memory_utilization"]
    if x.kv_elastic:
        if not 0 <= u <= 1:
            yield x.finding(
                "EL-04", f"{x.d('max_memory_utilization')} is not a ratio in [0, 1] "
                "(it is ignored by the elastic pool, but must still be a ratio)",
                ("max_memory_utilization", "vmm_elastic"),
                "remove max_memory_utilization (max_cache_size is the elastic pool's quota)")
        elif x.cfg.explicit("max_memory_utilization"):
            yield x.finding(
                "EL-02", f"{x.d('max_memory_utilization')} has no effect with "
                f"{x.d('vmm_elastic')}: the elastic pool ignores the ratio",
                ("max_memory_utilization", "vmm_elastic"),
                "remove max_memory_utilization; use max_cache_size as the byte quota")
    elif not 0 < u <= 1:
        mode = "fixed VMM pool" if x.kv else "physical KV cache"
        yield x.finding(
            "EL-03", f"the {mode} is sized by max_memory_utilization, which must be in "
            f"(0, 1], but {x.d('max_memory_utilization')}",
            ("max_memory_utilization",), "set max_memory_utilization to e.g. 0.8")


@_rule("EL-05")
def _el05(x: _Ctx) -> _Out:
    for n in ("max_cache_size", "vmm_memory_reserve_bytes"):
        if x.cfg[n] < 0:
            yield x.finding("EL-05", f"{x.d(n)} is negative", (n,),
                            f"set {n} to 0 or a positive number of bytes")


@_model_rule("EL-06", lambda x: x.kv and x.cfg["max_cache_size"] > 0)
def _el06(x: _Ctx, model) -> _Out:
    quota = x.cfg["max_cache_size"]
    from xllm_vmm.models import ModelConfigError, cache_layout

    try:
        layout = cache_layout(model, workers=_tp(x),
                              block_size=int(x.cfg["block_size"]),
                              kv_dtype=str(x.cfg["kv_cache_dtype"]), draft=x.mtp)
    except ModelConfigError as err:
        yield _not_checked("EL-06", f"the cache layout cannot be computed: {err}")
        return
    tensors = sum(len(g.tensors) for g in layout.groups)
    page = int(x.cfg["phy_page_granularity_size"])
    least = layout.least_pool_bytes(page)
    # VMM-02: with weight VMM on too, the quota covers the shared pool, weights included (the
    # architecture's estimate: check-config reads only config.json).
    weights = -(-model.served_weight_bytes // _tp(x)) if x.cfg["enable_vmm_weights"] else 0
    if quota < layout.least_quota_bytes(page, weights):
        shared = (f" plus {format_size(weights)} ({weights} bytes) of weights per worker in the "
                  "pool they share (VMM-02)") if weights else ""
        yield x.finding(
            "EL-06", f"{x.d('max_cache_size')} is below the least the pool can map for "
            f"{model.name}: one {format_size(page)} page for each of its {tensors} VMM tensors "
            f"per worker = {format_size(least)} ({least} bytes){shared}",
            ("max_cache_size", "phy_page_granularity_size", "nnodes", "devices", "dp_size")
            + (("enable_vmm_weights",) if weights else ()),
            f"set --max_cache_size to at least {least + weights} "
            f"({format_size(least + weights)}), or 0 for no quota")


def _tp(x: _Ctx) -> int:
    """Workers one model copy is split over (the engine's ``world / dp_size``)."""
    from xllm_vmm.config.parallel import parallel_of

    try:
        return parallel_of(x.cfg).tp
    except ValueError:  # a bad devices list is reported by VMM-01's check
        return 1


@_rule("EL-08")
def _el08(x: _Ctx) -> _Out:
    r = x.cfg["vmm_memory_reserve_bytes"]
    if not (x.elastic and r > 0):
        return
    if x.device_memory is None:
        yield _not_checked("EL-08", "the device's total memory is not known (pass "
                                    "--device-memory or --device PROFILE)")
    elif r > x.device_memory:
        yield x.finding(
            "EL-08", f"{x.d('vmm_memory_reserve_bytes')} is more than the device's "
            f"{format_size(x.device_memory)}: the pool could never grow",
            ("vmm_memory_reserve_bytes",),
            f"lower vmm_memory_reserve_bytes well below {x.device_memory}")


@_rule("PD-01")
def _pd01(x: _Ctx) -> _Out:
    c = x.cfg
    if (x.kv_elastic and c["enable_disagg_pd"]
            and str(c["kv_cache_transfer_type"]).strip().lower() == "mooncake"):
        names = ("kv_cache_transfer_type", "enable_disagg_pd", "vmm_elastic")
        yield x.finding(
            "PD-01", f"PD KV transfer over Mooncake needs a fully resident pool, but "
            f"{x.d(*names)}", names,
            "set --vmm_elastic=false and a positive --max_memory_utilization (e.g. 0.8)")


# ----------------------------------------------------------------------------- entry points


def find_model(cfg: ResolvedConfig):
    """The :class:`ModelSpec` named by ``cfg["model"]`` (a local directory: only its config.json
    is read, never a safetensors file; or a catalogue name), or ``(None, reason)`` when it
    cannot be read."""
    ref = cfg["model"]
    unresolved = getattr(cfg, "unresolved", {}).get("model")
    if unresolved is not None:
        return None, f"--model is not known here ({unresolved.message})"
    if not ref:
        return None, "no --model given"
    try:
        from xllm_vmm.models import ModelConfigError, load_model_spec
    except ImportError as err:  # pragma: no cover - the model reader ships with the package
        return None, f"the model reader is unavailable ({err})"
    try:
        return load_model_spec(str(ref), read_weights=False), None
    except ModelConfigError as err:
        return None, f"the model config could not be read: {err}"


def check(cfg: ResolvedConfig, model=None, *, model_reason: str | None = None,
          device_memory: int | None = None) -> Report:
    """Run every rule on ``cfg``.

    ``model``: the :class:`~xllm_vmm.models.spec.ModelSpec` for model rules, or None (model
    rules that apply are then listed in ``not_checked`` with ``model_reason``).
    ``device_memory`` (bytes, one device) decides EL-08. HK-07 needs the sizing plan: it is
    listed in ``not_checked`` when it applies; :func:`xllm_vmm.planner.checks.check_sizing`
    decides it.
    """
    x = _Ctx(cfg, model, model_reason, device_memory)
    report = Report(resolved=cfg, model=getattr(model, "name", None))
    resolved = cfg
    for _, fn in _CHECKS:
        for item in fn(x):
            if isinstance(item, Finding):
                report.findings.append(item)
            elif isinstance(item, Implied):
                report.implied.append(item)
                if item.key in FLAGS:
                    resolved = resolved.with_derived(item.key, item.value, item.rule)
            else:
                report.not_checked[item[0]] = item[1]
    report.resolved = resolved
    if model is None and model_reason is not None and "model" not in cfg.unresolved:
        bad = model_path_finding(cfg, model_reason)
        if bad is not None:
            report.findings.insert(0, bad)
    _drop_unresolved(report, cfg)
    return report


def _drop_unresolved(report: Report, cfg: ResolvedConfig) -> None:
    """A finding that names a flag whose value a launch script sets from what cannot be known
    here (``cfg.unresolved``) was decided on that flag's default, not on its real value: it
    becomes "not checked" (with the flag and its text), never an error or a warning."""
    if not cfg.unresolved:
        return
    kept = []
    for f in report.findings:
        names = [n for n in f.flags if n in cfg.unresolved]
        if not names:
            kept.append(f)
            continue
        texts = ", ".join(f"--{n} {cfg.unresolved[n].flags[n]!r}" for n in names)
        report.not_checked.setdefault(f.id, f"depends on {texts}, not known here")
    report.findings = kept


def is_local_model_path(ref: str) -> bool:
    """True when ``--model`` names a local path rather than a catalogue name or a hub id: it
    starts with ``/``, ``.`` or ``~``, ends with ``/``, has more than one ``/``, exists, or its
    parent directory exists (``models/qwen`` with a ``models`` directory here)."""
    import os

    ref = ref.strip()
    if not ref:
        return False
    if ref.startswith(("/", ".", "~")) or ref.endswith("/") or ref.count("/") > 1:
        return True
    path = os.path.expanduser(ref)
    if os.path.exists(path):
        return True
    parent = os.path.dirname(path)
    return bool(parent) and os.path.isdir(parent)


def model_path_finding(cfg: ResolvedConfig, reason: str) -> Finding | None:
    """``CFG-MODEL`` (warning; an error with ``--strict``): ``--model`` is a local path (:func:`is_local_model_path`) that is
    not a readable model directory (``reason`` says why), with the closest catalogue names.
    None for a name that is not a path (a hub id not in the catalogue stays "not checked").
    A warning, not an error: a launch script checked in CI names paths of the serving host,
    which the CI machine need not have, and the specification leaves the model rules "not
    checked" when the model is unreachable; the warning makes a typo visible, and ``--strict``
    fails on it."""
    ref = str(cfg["model"] or "")
    if not is_local_model_path(ref):
        return None
    from xllm_vmm.models.catalogue import closest_names

    close = closest_names(ref.rstrip("/").rsplit("/", 1)[-1])
    hint = ("pass a directory that holds the model's config.json, or a catalogue name"
            + (f" (closest: {', '.join(close)})" if close else "")
            + "; `xllm-vmm plan --list-models` lists the catalogue")
    from xllm_vmm.models import ModelConfigError, load_model_spec

    try:
        load_model_spec(ref, read_weights=False)
        why = reason
    except ModelConfigError as err:
        why = err.message + (f" ({err.source})" if err.source and err.source != ref else "")
        if _has_config_json(ref):
            # The model is here and its config.json (or GGUF header) holds what cannot be:
            # unreadable input.
            return Finding("CFG-MODEL-CONFIG", "error",
                           f"CFG-MODEL-CONFIG: {err.message} ({err.source or ref})",
                           flags={"model": cfg["model"]},
                           sources={"model": cfg.provenance("model")},
                           hint=err.hint, input=getattr(cfg, "label", ""))
    return Finding("CFG-MODEL", "warning",
                   f"CFG-MODEL: {cfg.describe('model')} is a local path but not a readable model "
                   f"directory here: {why}; its model rules are not checked",
                   flags={"model": cfg["model"]}, sources={"model": cfg.provenance("model")},
                   hint=hint, input=getattr(cfg, "label", ""))


def _has_config_json(ref: str) -> bool:
    import os

    path = os.path.expanduser(ref.strip())
    return os.path.isfile(os.path.join(path, "config.json")) or (
        os.path.isfile(path) and path.endswith((".json", ".gguf")))


def check_all(cfg: ResolvedConfig, **kwargs) -> Report:
    """:func:`check` with the model looked up from ``cfg["model"]`` (:func:`find_model`)."""
    model, reason = find_model(cfg)
    return check(cfg, model, model_reason=reason, **kwargs)
