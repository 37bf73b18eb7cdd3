"""``make_plan``: a model and :class:`PlanInputs` -> a :class:`Plan`, with every formula.

Per worker (one worker per device; ``W`` workers in all, the engine's world size ``nnodes ×
len(devices)``, in ``dp_size`` data-parallel groups of ``tp = W / dp_size`` workers in tensor
parallel, :mod:`xllm_vmm.config.parallel`), in bytes:

- weights ``Wt = ceil(weights_total / tp)`` (+ ``ceil(mtp_weights / tp)`` with an MTP draft, or
  ``ceil(draft_weights / tp)`` with a separate draft model read from its ``config.json``); with
  ``dp_size > 1`` this counts the MoE experts as split ``tp`` ways too, an upper bound where
  ``ep_size`` spreads them over more workers;
- execution peak ``P`` (default, unless overridden)::

      P = max_tokens_per_batch x e x (4 x hidden + 2 x ceil(I / tp))
          + max_seqs_per_batch x vocab x 4

  with ``e`` the model dtype's bytes and ``I`` the active MLP width (``intermediate_size`` for a
  dense model; ``moe_intermediate_size x experts_per_token`` plus the shared experts for MoE);
  the second term is the float32 logits of one token per sequence;
- budget ``B`` (memory for KV blocks and resident state):

  - physical / fixed VMM: ``B = floor(T x max_memory_utilization) - Wt - P``;
  - elastic VMM: ``free = T - Wt - O``; ``B = free - P - vmm_memory_reserve_bytes``
    (``max_memory_utilization`` ignored, EL-02);
  - either way capped by the quota ``Q``: ``B = min(B, Q)`` when ``max_cache_size > 0``, where
    ``Q = max_cache_size`` (minus ``Wt`` when weights share the pool, VMM-02);

- MTP hidden-state ("embedding") slots (AD-03), with MTP speculative decoding on (the target's
  MTP layers or an MTP ``draft_model``): ``M = max_seqs_per_batch`` slots of ``m = hidden x e``
  bytes (the target's hidden vector of one sequence the draft reads;
  :func:`mtp_embedding_bytes_per_seq`, the one home of the formula, which the engine's
  ``MtpSlotsKVManager`` slots are sized by), reserved outside the page pool:
  ``B_s = B - M x m`` (``B_s = B`` without MTP);
- hybrid state slots ``S`` (HY-01): the most sequences of the context length whose KV blocks
  plus resident state ``r`` fit: ``demand(S, L) + S x r <= B_s``, at most ``max_seqs_per_batch``;
  ``B_kv = B_s - S x r``;
- capacity: sliding groups get blocks for ``min(max_seqs_per_batch, c)`` windows, the rest of
  ``B_kv`` goes to the groups that grow with the context: ``N`` blocks each, tokens ``N x
  block_size``; ``max_concurrency`` is the most sequences of ``L`` tokens that fit ``B_kv``
  (``<= S`` for hybrid models, ``<= max_seqs_per_batch``);
- arena: physical 0; fixed VMM the mapped KV pool; elastic VMM the pool sized for
  ``min(T - Wt, Q)`` (the most it could ever hold); plus ``Wt`` when weights share the pool;
- host pool (HK-06): ``floor(arena_kv x host_blocks_factor / host_block) x host_block`` when host
  offload is on, ``host_block`` = one block of every group (the one home of the formula:
  :func:`xllm_vmm.kvcache.host_support.host_pool_size`, which serving sizes its pool with).

``T`` is the device total, ``O`` the runtime overhead (default 1 GiB).
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field

from xllm_vmm.models import CacheLayout, LayoutError, ModelSpec, cache_layout, dtype_bytes
from xllm_vmm.planner.capacity import Unit, ceil_div, demand, largest, max_blocks, max_seqs
from xllm_vmm.planner.inputs import DEFAULT_RUNTIME_OVERHEAD_BYTES, PlanInputs

SCHEMA_VERSION = 1


def _n(x: int | float) -> str:
    return f"{x:,}" if isinstance(x, int) else f"{x:g}"


def _gib(x: int) -> str:
    return f"{x / (1 << 30):,.2f} GiB"


@dataclass(frozen=True)
class Formula:
    figure: str
    formula: str  # symbolic
    numbers: str  # with this plan's numbers
    value: int | float | None


@dataclass(frozen=True)
class Reason:
    severity: str  # "error" (does not fit), "warning", "info"
    code: str
    message: str
    hint: str = ""


@dataclass
class GroupPlan:
    name: str
    tensors: int
    tensor_bytes_per_token: int
    bytes_per_token: int
    block_bytes: int  # all tensors of one block together
    tensor_block_bytes: int
    blocks_per_page: int
    slot_bytes: int
    max_tokens_per_seq: int | None
    blocks: int = 0  # capacity in blocks (per tensor)
    units: int = 0  # slots (VMM) or blocks (physical) allocated
    pool_bytes: int = 0


@dataclass
class WorkerPlan:
    index: int
    device_total_bytes: int
    weights_bytes: int
    execution_peak_bytes: int
    runtime_overhead_bytes: int
    physical_budget_bytes: int
    resident_bytes_per_seq: int
    resident_slots: int
    resident_bytes: int
    kv_pool_bytes: int
    arena_bytes: int
    elastic_min_bytes: int | None
    elastic_max_bytes: int | None
    host_pool_bytes: int
    kv_capacity_blocks: int
    kv_capacity_tokens: int
    max_concurrency: int
    groups: list[GroupPlan]
    mtp_embedding_bytes_per_seq: int = 0  # m: one MTP hidden-state slot (AD-03)
    mtp_embedding_slots: int = 0  # M: max_seqs_per_batch with MTP, else 0
    mtp_embedding_bytes: int = 0  # M x m, reserved outside the page pool


SERVE_ERROR_RULES = frozenset({"HK-07", "CFG-SERVE"})  # CFG-SERVE: config.parallel
"""Rules that are warnings in check-config and plan but refuse to serve (``check-config --explain HK-07``)."""


@dataclass
class Plan:
    spec: ModelSpec
    inputs: PlanInputs
    layout: CacheLayout | None
    context_len: int
    workers: list[WorkerPlan] = field(default_factory=list)
    reasons: list[Reason] = field(default_factory=list)
    formulas: list[Formula] = field(default_factory=list)
    max_context_len: int | None = None  # largest that fits one request; None = unbounded
    suggested_workers: int | None = None
    draft: ModelSpec | None = None  # a separate draft model, sized from its own config.json
    config_findings: list = field(default_factory=list)  # from the config rules, if checked

    @property
    def mode(self) -> str:
        return self.inputs.mode

    @property
    def fits(self) -> bool:
        return not any(r.severity == "error" for r in self.reasons)

    @property
    def verdict(self) -> str:
        return "fits" if self.fits else "does_not_fit"

    @property
    def serve_refuses(self) -> list[str]:
        """Rule ids that are warnings in ``plan`` but errors when serving (``check-config --explain HK-07``):
        the memory fits the device, but ``serve`` would refuse to start."""
        return sorted({str(f.get("id")) for f in self.config_findings
                       if f.get("id") in SERVE_ERROR_RULES})

    @property
    def weights_bytes_total(self) -> int:
        return self.spec.served_weight_bytes + self.draft_weight_bytes_total

    @property
    def draft_weight_bytes_total(self) -> int:
        """Weights of the draft: the separate draft model's, or the target's MTP layers'."""
        if self.draft is not None:
            return self.draft.served_weight_bytes
        return self.spec.mtp_weight_bytes if self._mtp else 0

    @property
    def _mtp(self) -> bool:
        return self.inputs.mtp and self.spec.mtp_layers > 0

    def worker_min(self, attr: str) -> int:
        """AD-02: the minimum of a per-worker figure across workers."""
        return min(getattr(w, attr) for w in self.workers) if self.workers else 0


def active_intermediate(spec: ModelSpec) -> int:
    """MLP width one token passes through: dense ``intermediate_size``, or for MoE
    ``moe_intermediate_size x experts_per_token`` plus the shared experts (the larger of the
    two when a model has dense and MoE layers)."""
    dense = spec.intermediate_size
    if not spec.num_experts:
        return dense
    cfg = spec.extra.get("config", {})
    moe_i = spec.moe_intermediate_size or spec.intermediate_size
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) or moe_i * spec.num_shared_experts
    moe = moe_i * max(spec.num_experts_per_tok, 1) + shared
    if spec.model_type == "gpt_oss":
        return moe
    return max(dense, moe)


def mtp_embedding_bytes_per_seq(hidden_size: int, dtype: str) -> int:
    """Bytes of one MTP hidden-state ("embedding") slot (AD-03): the target's hidden vector of
    one sequence, ``hidden_size x e`` with ``e`` the bytes of ``dtype`` (the model's). The one
    home of the formula: ``plan`` reserves ``max_seqs_per_batch`` of them and the engine sizes
    its ``MtpSlotsKVManager`` slots with it."""
    return int(hidden_size) * dtype_bytes(dtype)


def execution_peak(spec: ModelSpec, inp: PlanInputs) -> tuple[int, str]:
    """The default execution-peak estimate and its formula with numbers."""
    e = dtype_bytes(spec.dtype)
    i_w = ceil_div(active_intermediate(spec), inp.tp)
    act = inp.max_tokens_per_batch * e * (4 * spec.hidden_size + 2 * i_w)
    logits = inp.max_seqs_per_batch * spec.vocab_size * 4
    text = (f"{_n(inp.max_tokens_per_batch)} x {e} x (4 x {_n(spec.hidden_size)} + 2 x "
            f"{_n(i_w)}) + {_n(inp.max_seqs_per_batch)} x {_n(spec.vocab_size)} x 4")
    return act + logits, text


def prefill_chunk(inp: PlanInputs, context_len: int) -> int:
    """Tokens of one prefill chunk: ``min(max_tokens_per_batch, L)`` with chunked prefill,
    else the whole prompt ``L``."""
    return min(inp.max_tokens_per_batch, context_len) if inp.enable_chunked_prefill \
        else context_len


def _units(layout: CacheLayout, inp: PlanInputs, physical: bool, chunk: int) -> list[Unit]:
    out = []
    for g in layout.groups:
        unit_bytes, per_unit = (g.block_bytes, 1) if physical else \
            (g.slot_bytes(inp.page_bytes), g.blocks_per_page(inp.page_bytes))
        out.append(Unit(g.name, unit_bytes, per_unit, g.block_size, g.max_tokens_per_seq,
                        chunk if g.max_tokens_per_seq is not None else 0))
    return out


def _split(units: list[Unit], budget: int, window_seqs: int,
           context_len: int) -> tuple[int, dict[str, int], int]:
    """Carve ``budget``: sliding groups get blocks for ``window_seqs`` sequences' windows (at
    full window, capped by the context length) plus the prefill chunk in flight, the growing
    groups the most blocks ``N`` that fit the rest. Returns (N, units per group, bytes used)."""
    capped = [u for u in units if u.window is not None]
    growing = [u for u in units if u.window is None]
    per_group: dict[str, int] = {}
    used = 0
    for u in capped:
        blocks = window_seqs * u.seq_blocks(context_len) + \
            (u.prefill_extra(context_len) if window_seqs else 0)
        per_group[u.name] = ceil_div(blocks, u.blocks_per_unit)
        used += per_group[u.name] * u.unit_bytes
    n = max_blocks(growing, budget - used) if growing else 0
    for u in growing:
        per_group[u.name] = ceil_div(n, u.blocks_per_unit)
        used += per_group[u.name] * u.unit_bytes
    return n, per_group, used


def host_pool_reason(host_pool: int, device_kv: int, workers: int,
                     inp: PlanInputs, least_device_kv: int = 1) -> Reason | None:
    """HK-07: the warning when ``workers`` host pools of ``host_pool`` bytes (each sized from
    ``device_kv`` bytes of device KV capacity) exceed ``inp.host_memory_bytes``; None when they
    fit or the host memory is not known. ``least_device_kv``: the smallest device KV capacity a
    worker can have (one slot per group with VMM, one block per group without); a cap on the
    device KV capacity below it is never suggested. Shared by ``plan`` and ``check-config``."""
    have = inp.host_memory_bytes
    need = host_pool * workers
    if have is None or need <= have:
        return None
    factor_ok = math.floor(have / max(1, device_kv * workers) * 100) / 100
    cap = int(have / (inp.host_blocks_factor * workers))
    per = f"{_n(host_pool)} x {workers} workers, each" if workers > 1 else "1 worker:"
    cap_fits = cap >= least_device_kv
    cannot = (f"the host tier cannot fit at host_blocks_factor {inp.host_blocks_factor:g}: even "
              f"the least device KV capacity ({_n(least_device_kv)} bytes per worker) would need "
              f"{_n(int(least_device_kv * inp.host_blocks_factor) * workers)} bytes of host "
              "memory")
    if factor_ok > 1:
        hint = f"lower host_blocks_factor to at most {factor_ok:.2f}"
        if cap_fits:
            hint += (f", or cap each worker's device KV capacity at {_n(cap)} bytes "
                     f"({_gib(cap)}) with max_cache_size")
        else:
            hint = (f"{cannot}; lower host_blocks_factor to at most {factor_ok:.2f} (the largest "
                    "that fits at the current capacity), or turn the host tier off "
                    "(host_blocks_factor=0)")
    elif cap_fits:
        # A factor of 1 or less turns the tier off (HK-03): only a smaller device KV cache
        # (max_cache_size) keeps the tier, or the tier goes.
        verb = "lower max_cache_size" if inp.max_cache_size > 0 else "set max_cache_size"
        hint = (f"no host_blocks_factor above 1 fits (at most {factor_ok:.2f} would, and a "
                f"factor of 1 or less turns the host tier off, HK-03): {verb} so "
                f"each worker's device KV capacity is at most {_n(cap)} bytes ({_gib(cap)}) at "
                f"host_blocks_factor {inp.host_blocks_factor:g}, or turn the host tier off "
                "(host_blocks_factor=0)")
    else:
        hint = (f"{cannot}, and no factor above 1 fits at the current capacity (at most "
                f"{factor_ok:.2f} would; 1 or less turns the host tier off, HK-03): turn the host "
                "tier off (host_blocks_factor=0) or give the host more memory")
    return Reason(
        "warning", "HK-07", f"the host KV pool needs {_n(need)} bytes ({_gib(need)}; {per} "
        f"device KV capacity {_n(device_kv)} x host_blocks_factor "
        f"{inp.host_blocks_factor:g}), more than the {_n(have)} bytes ({_gib(have)}) of host "
        f"memory available ({inp.host_memory_source})",
        hint + "; serving refuses this configuration")


def make_plan(spec: ModelSpec, inp: PlanInputs, *, suggest: bool = True,
              draft: ModelSpec | None = None) -> Plan:
    """Size ``spec`` under ``inp``, in named steps: the cache layout, weights, groups and units,
    the live budget, the least pool (EL-06), capacity and concurrency, the arena, the host pool
    (HK-06/HK-07), the workers, the longest context and the verdict.

    ``draft``: a separate draft model (its own ``config.json``),
    sized instead of the target's MTP layers when speculative decoding is on
    (``num_speculative_tokens > 0``). Never raises for memory that does not fit: the plan's
    ``reasons`` say why and what to change. Raises :class:`~xllm_vmm.models.LayoutError` (or
    :class:`~xllm_vmm.planner.devices.DeviceError`) only for inputs that cannot be planned at
    all (non-positive sizes, unknown dtypes)."""
    from xllm_vmm.planner.devices import DeviceError

    _validate(inp)
    L = inp.context_len if inp.context_len is not None else spec.max_position_embeddings
    if L is None or L < 1:
        raise DeviceError("the model declares no max_position_embeddings",
                          hint="pass --context-len")
    plan = Plan(spec=spec, inputs=inp, layout=None, context_len=L)
    if inp.num_speculative_tokens <= 0:
        draft = None
    plan.draft = draft
    mtp = inp.mtp and spec.mtp_layers > 0 and draft is None
    if inp.mtp and not spec.mtp_layers and draft is None:
        plan.reasons.append(Reason(
            "warning", "DRAFT", f"MTP speculative decoding is on, but draft_model is not a "
            f"readable local model directory and {spec.name} has no MTP layers "
            "(num_nextn_predict_layers): the draft's cache and weights are not planned",
            "pass --draft_model=<a local directory with the draft's config.json>, or set "
            "num_speculative_tokens=0"))
    try:
        layout = cache_layout(spec, workers=inp.tp, block_size=inp.block_size,
                              kv_dtype=inp.kv_cache_dtype, draft=mtp or draft is not None,
                              draft_spec=draft)
    except LayoutError as exc:
        plan.reasons.append(Reason("error", "LAYOUT", exc.message, exc.hint))
        return plan
    plan.layout = layout
    physical = inp.mode == "physical"
    W, T, page = inp.workers, inp.device_memory_bytes, inp.page_bytes
    tp = inp.tp

    wt = _size_weights(plan, spec, draft, mtp, tp)
    groups = _size_groups(plan, layout, page, physical)
    if not plan.fits:
        return plan
    _chunk, units, r = _size_units(plan, layout, inp, physical, L)
    P, O, quota, held, budget = _size_budget(plan, spec, inp, wt, T)
    min_pool = _check_least_pool(plan, layout, inp, units, physical, page, quota, held, wt)
    m, M = _size_mtp_slots(plan, spec, inp, draft, budget)
    state_budget = budget - M * m
    S, _kv_budget, conc, window_seqs, n_blocks, used, tokens = _size_capacity(
        plan, layout, inp, units, groups, L, state_budget, r, "B_s" if M else "B")
    arena_kv, arena = _size_arena(plan, inp, units, physical, T, wt, S, r, quota, used,
                                  window_seqs, L, M * m)
    host_pool = _size_host_pool(plan, layout, inp, physical, arena_kv, used, W, min_pool)
    for i in range(W):
        plan.workers.append(WorkerPlan(
            index=i, device_total_bytes=T, weights_bytes=wt, execution_peak_bytes=P,
            runtime_overhead_bytes=O if inp.mode == "elastic_vmm" else 0,
            physical_budget_bytes=budget, resident_bytes_per_seq=r, resident_slots=S,
            resident_bytes=S * r, kv_pool_bytes=used, arena_bytes=arena,
            elastic_min_bytes=min_pool if inp.mode == "elastic_vmm" else None,
            elastic_max_bytes=used if inp.mode == "elastic_vmm" else None,
            host_pool_bytes=host_pool, kv_capacity_blocks=n_blocks, kv_capacity_tokens=tokens,
            max_concurrency=conc, groups=[GroupPlan(**vars(g)) for g in groups],
            mtp_embedding_bytes_per_seq=m, mtp_embedding_slots=M, mtp_embedding_bytes=M * m))

    _find_max_context(plan, units, r, state_budget)
    _verdict(plan, spec, inp, draft, suggest, units, L, budget, wt, P, O, T, conc, r)
    return plan


def _size_weights(plan: Plan, spec: ModelSpec, draft: ModelSpec | None, mtp: bool,
                  tp: int) -> int:
    """Weights per worker: the served model's, plus the MTP layers' or the separate draft's, split
    ``tp`` ways."""
    f = plan.formulas.append
    wt_total = spec.served_weight_bytes
    wt = ceil_div(wt_total, tp)
    src = "safetensors headers" if spec.weight_bytes_exact else "estimated from the architecture"
    for m in (spec, draft):
        if m is not None and m.weights_warning:
            plan.reasons.append(Reason(
                "warning", "WEIGHTS", f"the safetensors headers of {m.name} were not used: "
                f"{m.extra['safetensors_error'].message} "
                f"({m.extra['safetensors_error'].source}); the weights are estimated from the "
                "architecture", "re-download or remove the damaged file for exact weight bytes"))
    for m in (spec, draft):
        note = m.extra.get("weights_assumed") if m is not None and not m.weight_bytes_exact \
            else None
        if note:
            plan.reasons.append(Reason(
                "warning", "WEIGHTS", f"{m.name}: {note}",
                "add bits to quantization_config, or point --model at the checkpoint with its "
                "safetensors files for exact weight bytes"))
    f(Formula("weights per worker", "ceil(weights / tp)",
              f"ceil({_n(wt_total)} / {tp}) ({src})", wt))
    if mtp:
        mw = ceil_div(spec.mtp_weight_bytes, tp)
        f(Formula("MTP draft weights per worker", "ceil(mtp_weights / tp)",
                  f"ceil({_n(spec.mtp_weight_bytes)} / {tp})", mw))
        wt += mw
    if draft is not None:
        dw = ceil_div(draft.served_weight_bytes, tp)
        f(Formula(f"draft model weights per worker ({draft.name})",
                  "ceil(draft_weights / tp)",
                  f"ceil({_n(draft.served_weight_bytes)} / {tp}) ("
                  + ("safetensors headers" if draft.weight_bytes_exact
                     else "estimated from the architecture") + ")", dw))
        wt += dw

    return wt


def _size_groups(plan: Plan, layout: CacheLayout, page: int, physical: bool) -> list[GroupPlan]:
    """The per-group figures (bytes per token, block, blocks per page, slot); a block larger than a
    page is the error PAGE."""
    f = plan.formulas.append
    groups: list[GroupPlan] = []
    for g in layout.groups:
        gp = GroupPlan(g.name, len(g.tensors), g.tensor_bytes_per_token, g.bytes_per_token,
                       g.block_bytes, g.tensor_block_bytes, g.blocks_per_page(page),
                       g.slot_bytes(page), g.max_tokens_per_seq)
        groups.append(gp)
        f(Formula(f"[{g.name}] KV bytes per token", "tensors x tensor bytes per token",
                  f"{gp.tensors} x {_n(gp.tensor_bytes_per_token)}", gp.bytes_per_token))
        f(Formula(f"[{g.name}] block bytes", "bytes per token x block_size",
                  f"{_n(gp.bytes_per_token)} x {g.block_size}", gp.block_bytes))
        f(Formula(f"[{g.name}] blocks per page", "floor(page / (tensor bytes per token x "
                  "block_size))", f"floor({_n(page)} / {_n(gp.tensor_block_bytes)})",
                  gp.blocks_per_page))
        f(Formula(f"[{g.name}] slot bytes", "page x tensors", f"{_n(page)} x {gp.tensors}",
                  gp.slot_bytes))
        if gp.blocks_per_page < 1 and not physical:
            plan.reasons.append(Reason(
                "error", "PAGE", f"one block of group {g.name!r} ({_n(gp.tensor_block_bytes)} "
                f"bytes per tensor) is larger than a page ({_n(page)} bytes)",
                "lower --block_size so that a block fits in a page"))
    return groups


def _size_units(plan: Plan, layout: CacheLayout, inp: PlanInputs, physical: bool,
                L: int) -> tuple[int, list[Unit], int]:
    """The allocation units of every group, the prefill chunk and the resident state per
    sequence."""
    f = plan.formulas.append
    chunk = prefill_chunk(inp, L)
    units = _units(layout, inp, physical, chunk)
    r = layout.resident.bytes_per_seq if layout.resident else 0
    for u in units:
        if u.window is not None:
            f(Formula(f"[{u.name}] blocks per sequence (window {_n(u.window)})",
                      "min(ceil(L / block_size), ceil((window + block_size - 1) / block_size))",
                      f"L={_n(L)}, block_size={u.block_size}", u.seq_blocks(L)))
            f(Formula(f"[{u.name}] prefill chunk blocks (once per pool)",
                      "min(ceil(L / block_size), ceil((window - 1 + C + block_size - 1) / "
                      "block_size)) - blocks per sequence, C = "
                      + ("min(max_tokens_per_batch, L)" if inp.enable_chunked_prefill
                         else "L (chunked prefill off)"),
                      f"C={_n(chunk)}", u.prefill_extra(L)))

    return chunk, units, r


def _size_budget(plan: Plan, spec: ModelSpec, inp: PlanInputs, wt: int,
                 T: int) -> tuple[int, int, int | None, int, int]:
    """Execution peak ``P``, runtime overhead ``O``, quota ``Q`` and the live budget ``B`` (the
    pool's
    formula, :func:`xllm_vmm.pool.budget.budget_bytes`)."""
    f = plan.formulas.append
    if inp.execution_peak_bytes is None:
        P, text = execution_peak(spec, inp)
        f(Formula("execution peak (default)", "max_tokens_per_batch x e x (4 x hidden + 2 x "
                  "ceil(I / tp)) + max_seqs_per_batch x vocab x 4", text, P))
    else:
        P = inp.execution_peak_bytes
        f(Formula("execution peak (given)", "--execution-peak", _n(P), P))
    O = DEFAULT_RUNTIME_OVERHEAD_BYTES if inp.runtime_overhead_bytes is None \
        else inp.runtime_overhead_bytes
    quota = None
    if inp.max_cache_size > 0:
        quota = inp.max_cache_size - (wt if inp.shared_pool else 0)
        f(Formula("quota Q", "max_cache_size" + (" - weights (shared pool, VMM-02)"
                                                 if inp.shared_pool else ""),
                  _n(inp.max_cache_size) + (f" - {_n(wt)}" if inp.shared_pool else ""), quota))
    # The live budget: the pool's own formula (xllm_vmm.pool.budget.budget_bytes), uncapped
    # then capped by the quota, with the weights held by the pool when it is shared (VMM-02).
    from xllm_vmm.pool.budget import BudgetConfig, BudgetMode, budget_bytes

    elastic = inp.mode == "elastic_vmm"
    held = wt if inp.shared_pool else 0
    free = T - wt - O if elastic else T - wt

    def live_budget(max_cache_size: int) -> int:
        cfg = BudgetConfig(
            mode=BudgetMode.ELASTIC if elastic else BudgetMode.FIXED if inp.enable_vmm_kvcache
            else BudgetMode.PHYSICAL,
            max_memory_utilization=0.0 if elastic else inp.max_memory_utilization,
            max_cache_size=max_cache_size,
            reserve_bytes=inp.vmm_memory_reserve_bytes if elastic else 0)
        return budget_bytes(cfg, total=T, free=free, execution_peak=P, held=held)

    budget = live_budget(0)
    if elastic:
        f(Formula("free at start", "total - weights - runtime overhead",
                  f"{_n(T)} - {_n(wt)} - {_n(O)}", free))
        f(Formula("physical budget B (elastic)", "free - execution peak - "
                  "vmm_memory_reserve_bytes" + (", capped by Q" if quota is not None else ""),
                  f"{_n(free)} - {_n(P)} - {_n(inp.vmm_memory_reserve_bytes)}", budget))
    else:
        f(Formula(f"physical budget B ({inp.mode})", "floor(total x max_memory_utilization) - "
                  "weights - execution peak" + (", capped by Q" if quota is not None else ""),
                  f"floor({_n(T)} x {inp.max_memory_utilization:g}) - {_n(wt)} - {_n(P)}",
                  budget))
    if quota is not None:
        capped = live_budget(inp.max_cache_size)
        if capped < budget:
            budget = capped
            f(Formula("physical budget B (capped)", "min(B, Q)", _n(quota), budget))
    if quota is not None and quota <= 0:
        plan.reasons.append(Reason(
            "error", "QUOTA", f"max_cache_size={_n(inp.max_cache_size)} leaves nothing for the "
            f"KV cache after the weights ({_n(wt)} bytes per worker) in the shared pool",
            f"raise max_cache_size above {_n(wt)} or set it to 0 (no quota)"))

    return P, O, quota, held, budget


def _check_least_pool(plan: Plan, layout: CacheLayout, inp: PlanInputs, units: list[Unit],
                      physical: bool, page: int, quota: int | None, held: int, wt: int) -> int:
    """The least pool (one slot per group) and EL-06 against the quota."""
    f = plan.formulas.append
    min_pool = layout.least_pool_bytes(page) if not physical else \
        sum(u.unit_bytes for u in units)
    if not physical:
        f(Formula("least pool (one slot per group)", "sum of slot bytes", " + ".join(
            _n(u.unit_bytes) for u in units), min_pool))
        if quota is not None and quota > 0 and \
                inp.max_cache_size < layout.least_quota_bytes(page, held):
            plan.reasons.append(Reason(
                "error", "EL-06", f"max_cache_size={_n(inp.max_cache_size)} is smaller than one "
                f"page for every VMM tensor: the least the pool can map is {_n(min_pool)} bytes"
                + (" after the weights" if inp.shared_pool else ""),
                f"set max_cache_size to at least {_n(min_pool + (wt if inp.shared_pool else 0))}"
                " or to 0 (no quota)"))

    return min_pool


def _size_mtp_slots(plan: Plan, spec: ModelSpec, inp: PlanInputs, draft: ModelSpec | None,
                    budget: int) -> tuple[int, int]:
    """MTP hidden-state slots (AD-03): ``(m, M)``, bytes per slot and slots; ``(0, 0)``
    without MTP speculative decoding (or with nothing to draft with)."""
    if not inp.mtp or (draft is None and not spec.mtp_layers):
        return 0, 0
    f = plan.formulas.append
    src = draft if draft is not None else spec
    m = mtp_embedding_bytes_per_seq(src.hidden_size, spec.dtype)
    M = inp.max_seqs_per_batch
    f(Formula("MTP embedding slot bytes m (AD-03)", "hidden x e",
              f"{_n(src.hidden_size)} x {dtype_bytes(spec.dtype)}", m))
    f(Formula("MTP embedding slots M", "max_seqs_per_batch", _n(M), M))
    f(Formula("budget after MTP slots B_s", "B - M x m", f"{_n(budget)} - {_n(M)} x {_n(m)}",
              budget - M * m))
    return m, M


def _size_capacity(plan: Plan, layout: CacheLayout, inp: PlanInputs, units: list[Unit],
                   groups: list[GroupPlan], L: int, budget: int,
                   r: int, budget_name: str = "B") -> tuple[int, int, int, int, int, int, int]:
    """Hybrid state slots ``S``, the KV budget, concurrency at ``L`` and the KV capacity (blocks,
    tokens, bytes of pool used); ``budget`` is ``budget_name`` (``B``, or ``B_s`` after the MTP
    slots)."""
    f = plan.formulas.append
    # Hybrid state slots, concurrency, capacity.
    if r:
        S = min(inp.max_seqs_per_batch, max_seqs(units, L, budget, r))
        f(Formula("resident state per sequence (HY-01)", "conv + recurrent",
                  f"{_n(layout.resident.conv_bytes_per_seq)} + "
                  f"{_n(layout.resident.recurrent_bytes_per_seq)}", r))
        f(Formula("resident state slots S", "max S <= max_seqs_per_batch with "
                  f"demand(S, L) + S x r <= {budget_name}",
                  f"L={_n(L)}, r={_n(r)}, {budget_name}={_n(budget)}", S))
    else:
        S = 0
    kv_budget = budget - S * r
    c_fit = max_seqs(units, L, kv_budget)
    conc = min(c_fit, inp.max_seqs_per_batch, S if r else c_fit)
    window_seqs = min(inp.max_seqs_per_batch, c_fit)
    n_blocks, per_group, used = _split(units, kv_budget, window_seqs, L)
    for gp, u in zip(groups, units):
        gp.units = per_group.get(u.name, 0)
        gp.blocks = gp.units * u.blocks_per_unit
        gp.pool_bytes = gp.units * u.unit_bytes
    tokens = n_blocks * inp.block_size
    windows = sum(gp.pool_bytes for gp in groups if gp.max_tokens_per_seq is not None)
    f(Formula("KV budget B_kv", f"{budget_name} - S x r", f"{_n(budget)} - {_n(S)} x {_n(r)}",
              kv_budget))
    f(Formula("KV capacity N (blocks per growing group)", "max N with sum over growing groups "
              "of ceil(N / blocks per unit) x unit bytes <= B_kv - sliding windows",
              f"{_n(kv_budget)} - {_n(windows)}", n_blocks))
    f(Formula("KV capacity (tokens)", "N x block_size", f"{_n(n_blocks)} x {inp.block_size}",
              tokens))
    f(Formula(f"max concurrency at L={_n(L)}", "max c with demand(c, L) <= B_kv, at most "
              "max_seqs_per_batch" + (" and S" if r else ""),
              f"one request needs {_n(demand(units, 1, L) + r)} bytes", conc))

    return S, kv_budget, conc, window_seqs, n_blocks, used, tokens


def _size_arena(plan: Plan, inp: PlanInputs, units: list[Unit], physical: bool, T: int, wt: int,
                S: int, r: int, quota: int | None, used: int, window_seqs: int,
                L: int, mtp_bytes: int = 0) -> tuple[int, int]:
    """The virtual arena: the KV pool it reserves (fixed: the mapped pool; elastic: the pool sized
    for the most it could hold, after the resident state and the MTP slots ``mtp_bytes``) plus
    the weights of a shared pool."""
    f = plan.formulas.append
    if physical:
        arena_kv = 0
    elif inp.mode == "fixed_vmm":
        arena_kv = used
    else:
        arena_budget = T - wt - S * r - mtp_bytes
        if quota is not None:
            arena_budget = min(arena_budget, quota - S * r - mtp_bytes)
        arena_kv = _split(units, arena_budget, window_seqs, L)[2]
    arena = arena_kv + (wt if (inp.shared_pool and not physical) else 0)
    if not physical:
        f(Formula("arena (virtual bytes reserved)",
                  ("mapped KV pool" if inp.mode == "fixed_vmm" else
                   "KV pool sized for min(total - weights, Q)")
                  + (" + weights (shared pool)" if inp.shared_pool else ""),
                  f"{_n(arena_kv)}" + (f" + {_n(wt)}" if inp.shared_pool else ""), arena))

    return arena_kv, arena


def _size_host_pool(plan: Plan, layout: CacheLayout, inp: PlanInputs, physical: bool,
                    arena_kv: int, used: int, W: int, min_pool: int) -> int:
    """HK-06: the host pool (the one formula, :mod:`xllm_vmm.kvcache.host_support`) and HK-07."""
    f = plan.formulas.append
    host_pool = 0
    if inp.host_offload:
        from xllm_vmm.kvcache.host_support import host_block_bytes, host_pool_size

        base = arena_kv if not physical else used
        host_block = host_block_bytes(layout)
        host_pool = host_pool_size(base, inp.host_blocks_factor, host_block).bytes
        f(Formula("host pool (HK-06)", "floor(device KV tensor capacity x host_blocks_factor / "
                  "host block) x host block (a host block: one block of every group)",
                  f"floor({_n(base)} x {inp.host_blocks_factor:g} / {_n(host_block)}) x "
                  f"{_n(host_block)}", host_pool))
        hk07 = host_pool_reason(host_pool, base, W, inp,
                                least_device_kv=host_block if physical else min_pool)
        if hk07 is not None:
            plan.reasons.append(hk07)

    return host_pool


def _find_max_context(plan: Plan, units: list[Unit], r: int, budget: int) -> None:
    """The largest context length one request can have (exactly)."""
    def one_fits(length: int) -> bool:
        return demand(units, 1, length) + r <= budget

    growing = any(u.window is None for u in units)
    if budget <= 0:
        plan.max_context_len = 0
    elif not growing:
        plan.max_context_len = None if one_fits(1) else 0
    else:
        plan.max_context_len = max(largest(one_fits, 1) or 0, 0)



def _verdict(plan: Plan, spec: ModelSpec, inp: PlanInputs, draft: ModelSpec | None, suggest: bool,
             units: list[Unit], L: int, budget: int, wt: int, P: int, O: int, T: int, conc: int,
             r: int) -> None:
    """The reasons a plan does not fit (MEMORY, CONTEXT), CONTEXT-MAX, and the worker count that
    would fit."""
    if budget <= 0:
        need = wt + P + (inp.vmm_memory_reserve_bytes + O if inp.mode == "elastic_vmm" else 0)
        have = T if inp.mode == "elastic_vmm" else int(T * inp.max_memory_utilization)
        plan.reasons.append(Reason(
            "error", "MEMORY", f"no memory is left for the KV cache on each worker: weights "
            f"{_n(wt)} + execution peak {_n(P)}"
            + (f" + runtime overhead {_n(O)} + reserve {_n(inp.vmm_memory_reserve_bytes)}"
               if inp.mode == "elastic_vmm" else "")
            + f" = {_n(need)} bytes of {_n(have)} usable",
            "use more workers (nnodes: one process per device, or more --devices per process) "
            "or a device with more memory"
            # A higher ratio helps only when the whole device would hold weights and peak.
            + (", or a higher max_memory_utilization"
               if inp.mode != "elastic_vmm" and wt + P < T else "")))
    elif conc < 1 and plan.fits:
        need = demand(units, 1, L) + r
        plan.reasons.append(Reason(
            "error", "CONTEXT", f"one request of {_n(L)} tokens needs {_n(need)} bytes of KV "
            f"cache{' and resident state' if r else ''} per worker; the budget is {_n(budget)}",
            f"lower --context-len to at most {_n(plan.max_context_len or 0)}, use more workers, "
            "or give the cache more memory"))
    if spec.max_position_embeddings and L > spec.max_position_embeddings:
        plan.reasons.append(Reason(
            "warning", "CONTEXT-MAX", f"context length {_n(L)} exceeds the model's "
            f"max_position_embeddings {_n(spec.max_position_embeddings)}",
            "the model was not trained for it; lower --context-len"))
    if suggest and not plan.fits and any(x.code in ("MEMORY", "CONTEXT") for x in plan.reasons):
        plan.suggested_workers = _suggest_workers(spec, inp, draft)
        if plan.suggested_workers:
            plan.reasons.append(Reason(
                "info", "WORKERS", f"{plan.suggested_workers} workers would fit "
                f"{_n(L)} tokens", f"use {plan.suggested_workers} workers "
                f"(nnodes={plan.suggested_workers} with one device per process)"))


def valid_worker_counts(spec: ModelSpec, inp: PlanInputs, draft: ModelSpec | None = None,
                        limit: int = 128) -> list[int]:
    """Worker counts up to ``limit`` for which ``spec`` (and ``draft``) can be laid out with
    ``inp``'s block size and KV dtype (heads split or replicated evenly)."""
    out = []
    for w in range(1, limit + 1):
        try:
            cache_layout(spec, workers=w, block_size=inp.block_size, kv_dtype=inp.kv_cache_dtype,
                         draft=draft is not None, draft_spec=draft)
        except LayoutError:
            continue
        out.append(w)
    return out


def _suggest_workers(spec: ModelSpec, inp: PlanInputs, draft: ModelSpec | None) -> int | None:
    import dataclasses

    for w in range(inp.workers + 1, 129):
        if w % max(1, inp.dp_size):
            continue  # the workers of the service are dp_size groups of equal size
        try:
            cache_layout(spec, workers=w // max(1, inp.dp_size), block_size=inp.block_size,
                         kv_dtype=inp.kv_cache_dtype)
        except LayoutError:
            continue
        if make_plan(spec, dataclasses.replace(inp, workers=w), suggest=False,
                     draft=draft).fits:
            return w
    return None


def _validate(inp: PlanInputs) -> None:
    from xllm_vmm.planner.devices import DeviceError

    def need(ok: bool, what: str, value, hint: str) -> None:
        if not ok:
            raise DeviceError(f"{what} must be {hint}, got {value!r}", hint=f"fix {what}")

    need(inp.workers >= 1, "workers (nnodes x devices)", inp.workers, "at least 1")
    need(inp.dp_size >= 1 and inp.workers % inp.dp_size == 0, "dp_size", inp.dp_size,
         f"a divisor of the {inp.workers} workers")
    need(inp.device_memory_bytes > 0, "device memory", inp.device_memory_bytes,
         "a positive number of bytes")
    need(inp.page_bytes > 0, "page size", inp.page_bytes, "a positive number of bytes")
    need(inp.block_size >= 1, "block_size", inp.block_size, "a positive number of tokens")
    need(inp.context_len is None or inp.context_len >= 1, "context length", inp.context_len,
         "at least 1 token")
    need(inp.max_cache_size >= 0, "max_cache_size", inp.max_cache_size, ">= 0 (EL-05)")
    need(inp.vmm_memory_reserve_bytes >= 0, "vmm_memory_reserve_bytes",
         inp.vmm_memory_reserve_bytes, ">= 0 (EL-05)")
    need(inp.host_blocks_factor >= 0, "host_blocks_factor", inp.host_blocks_factor, ">= 0 (HK-08)")
    need(inp.max_seqs_per_batch >= 1, "max_seqs_per_batch", inp.max_seqs_per_batch, ">= 1")
    need(inp.max_tokens_per_batch >= 1, "max_tokens_per_batch", inp.max_tokens_per_batch, ">= 1")
    need(inp.execution_peak_bytes is None or inp.execution_peak_bytes >= 0, "execution peak",
         inp.execution_peak_bytes, ">= 0 bytes")
    need(inp.runtime_overhead_bytes is None or inp.runtime_overhead_bytes >= 0,
         "runtime overhead", inp.runtime_overhead_bytes, ">= 0 bytes")
    if inp.mode != "elastic_vmm":
        need(0 < inp.max_memory_utilization <= 1, "max_memory_utilization",
             inp.max_memory_utilization, "in (0, 1] for physical KV and fixed VMM (EL-03)")
