"""``Worker``: one device's compute — its pool's weights, the model, K/V views over the
virtual KV cache, the attention backend — executing plain step descriptions.

``Worker.create(model_dir, *, pool, kv_cache, dtype, weights, attention_backend)`` (contract
section 3):

- the model's layout-side spec comes from :func:`xllm_vmm.models.load_model_spec` (the same
  reader ``plan`` uses) and its compute-side fields from ``config.json``
  (:class:`~xllm_vmm.engine.models.config.ModelConfig`);
- weights: ``weights`` (a ``ModelWeights`` from :func:`xllm_vmm.weights.load_weights`, possibly
  viewing the pool's arena) when given, else :func:`load_model_weights` (plain tensors, or the
  pool when ``vmm_weights``); the model references these tensors (no copies), so their
  addresses stay valid across sleep / wakeup, and every step first calls the weights'
  ``check_loaded()`` (a typed error while asleep);
- K/V: every layer's K and V view the ``"attn"`` group of ``kv_cache`` in place
  (:class:`~xllm_vmm.engine.attention.kv.KVCacheViews`);
- the device follows the pool's driver (host → CPU, cuda → ``cuda:<i>``, acl → ``npu:<i>``;
  the ACL emulation → CPU); on the CPU, glibc's malloc is tuned once for the process
  (:func:`xllm_vmm.engine.host_memory.configure_host_malloc`; ``XLLM_VMM_MALLOPT=0`` keeps
  glibc's defaults);
- plain weights (not the pool's) are re-laid so that each layer's q/k/v and gate/up lie back to
  back (:func:`xllm_vmm.engine.layers.fusion.colocate_projections`: the same tensor objects,
  values and byte counts) and run as one product each; pool weights are never moved: the
  pool's image already places each group back to back
  (:func:`xllm_vmm.weights.image.placement_order`), and they fuse as views; on the CPU in
  bfloat16 the dense decoder's projections of plain weights are replaced by oneDNN-packed copies
  (:func:`xllm_vmm.engine.models.packing.pack_model`; ``XLLM_VMM_PACKED_LINEAR=0`` keeps them).

Tensor parallelism: ``tp`` (:class:`~xllm_vmm.engine.layers.parallel.TensorParallel`)
reaches every layer; only world size 1 runs today.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from xllm_vmm.engine.layers.parallel import SINGLE, TensorParallel

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from xllm_vmm.engine.step import StepInput, StepOutput
    from xllm_vmm.kvcache import VirtualKVCache
    from xllm_vmm.pool import VmmPool

_DTYPES = {"float32": "float32", "fp32": "float32", "float": "float32",
           "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16", "half": "float16"}


def resolve_dtype(dtype: Any, config_dtype: str) -> torch.dtype:
    """The compute dtype: a ``torch.dtype``, a name (``float32``, ``bfloat16``, ``float16`` and
    their short forms) or ``"auto"``/None (the checkpoint's ``dtype``; float32 if unknown)."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    name = config_dtype if dtype in (None, "auto") else str(dtype).lower()
    key = _DTYPES.get(name)
    if key is None:
        if dtype in (None, "auto"):
            return torch.float32
        raise ValueError(f"dtype {dtype!r} is not supported; use auto, float32, bfloat16 or float16")
    return getattr(torch, key)


def device_of(driver: Any) -> str:
    """The torch device whose memory ``driver`` maps."""
    kind = getattr(driver, "device_kind", "cpu")
    if kind == "cpu" or getattr(driver, "emulated", False):
        return "cpu"
    return f"{kind}:{getattr(driver, 'device_index', 0)}"


def load_model_weights(model_dir: str | Path, *, pool: VmmPool | None = None,
                       dtype: torch.dtype | None = None, device: str = "cpu") -> Mapping[str, Any]:
    """The one way the engine loads a checkpoint's tensors: :func:`xllm_vmm.weights.load_weights`
    (``pool`` given: tensors view the pool's weights tenant; None: plain tensors, moved to
    ``device`` when that is not the CPU). ``dtype`` converts floating-point tensors."""
    from xllm_vmm.weights import load_weights

    weights = load_weights(str(model_dir), pool=pool, dtype=dtype)
    if pool is None and device != "cpu":  # plain tensors: the device's own copies
        weights = {name: t.to(device) for name, t in weights.items()}
    if pool is None:  # q/k/v, gate/up back to back: one product each (layers.fusion)
        from xllm_vmm.engine.layers.fusion import colocate_projections

        colocate_projections(weights)
    return weights


def weights_in_pool(weights: Mapping[str, Any]) -> bool:
    """The tensors view a VMM pool (their addresses must never change: sleep, wakeup and fork
    refer to them), as opposed to plain tensors the engine may re-lay."""
    return bool(getattr(weights, "device_bytes", 0)) or bool(getattr(weights, "vmm", False))


class Worker:
    """Executes :class:`~xllm_vmm.engine.step.StepInput` on one device (see the module doc)."""

    def __init__(self, *, model_dir: str, model_spec: Any, hf_config: Any, weights: Any,
                 model: Any, kv_views: Any, runner: Any, pool: Any, kv_cache: Any,
                 device: str, owns_weights: bool = False) -> None:
        self.owns_weights = owns_weights
        self.model_dir = model_dir
        self.model_spec = model_spec
        self.hf_config = hf_config
        self.weights = weights
        self.model = model
        self.kv_views = kv_views
        self.runner = runner
        self.pool = pool
        self.kv_cache = kv_cache
        self.device = device

    @classmethod
    def create(cls, model_dir: str | Path, *, pool: VmmPool, kv_cache: VirtualKVCache,
               dtype: Any = "auto", weights: Mapping[str, Any] | None = None,
               attention_backend: str = "auto", vmm_weights: bool = False,
               tp: TensorParallel = SINGLE) -> Worker:
        from xllm_vmm.engine.attention import KVCacheViews, select_backend
        from xllm_vmm.engine.models import ModelConfig, build_model
        from xllm_vmm.engine.runner import ModelRunner
        from xllm_vmm.models import load_model_spec

        model_dir = str(model_dir)
        spec = load_model_spec(model_dir)
        cfg = ModelConfig.from_dir(model_dir)
        compute_dtype = resolve_dtype(dtype, cfg.dtype)
        device = device_of(pool.driver)
        if device == "cpu":  # keep freed activations in the heap (host_memory; process-wide)
            from xllm_vmm.engine.host_memory import configure_host_malloc

            configure_host_malloc()
        owns = weights is None
        if owns:
            weights = load_model_weights(model_dir, pool=pool if vmm_weights else None,
                                         dtype=compute_dtype, device=device)
        check_loaded = getattr(weights, "check_loaded", None)
        if check_loaded is not None:
            check_loaded()
        if not owns and not weights_in_pool(weights):  # the caller's plain tensors
            from xllm_vmm.engine.layers.fusion import colocate_projections

            colocate_projections(weights)  # same tensor objects and values, one buffer a group
        model = build_model(cfg, weights, tp=tp, device=device)
        if device == "cpu" and not weights_in_pool(weights):  # bf16: oneDNN-packed copies
            from xllm_vmm.engine.models.packing import pack_model

            model.packed = pack_model(model, weights)  # replace the originals (models.packing)
        if model.dtype != compute_dtype:
            raise ValueError(f"the weights are {model.dtype}, the worker was asked for "
                             f"{compute_dtype}; load them with dtype={compute_dtype}")
        make_kv = getattr(model, "make_kv", None)
        if make_kv is not None:  # families with their own cache groups (MLA, hybrid)
            views, backend = make_kv(kv_cache, compute_dtype=compute_dtype,
                                     attention_backend=attention_backend, device=device)
        else:
            heads_kv = max(1, cfg.num_kv_heads // tp.world_size)
            views = KVCacheViews(kv_cache, num_layers=cfg.num_layers, num_kv_heads=heads_kv,
                                 head_dim=cfg.head_dim, compute_dtype=compute_dtype)
            backend = select_backend(attention_backend, views.geometry,
                                     num_heads=cfg.num_heads // tp.world_size,
                                     num_kv_heads=heads_kv, head_dim=cfg.head_dim, device=device)
        runner = ModelRunner(model, views, backend, device, check_loaded=check_loaded)
        return cls(model_dir=model_dir, model_spec=spec, hf_config=cfg, weights=weights,
                   model=model, kv_views=views, runner=runner, pool=pool, kv_cache=kv_cache,
                   device=device, owns_weights=owns)

    @property
    def block_size(self) -> int:
        return self.kv_views.geometry.block_size

    def execute(self, step: StepInput) -> StepOutput:
        """Run one step (see :class:`~xllm_vmm.engine.runner.ModelRunner`)."""
        if self.runner is None:
            raise RuntimeError("this worker was closed; create a new one (Worker.create)")
        return self.runner.execute(step)

    def close(self) -> None:
        """Drop every tensor this worker holds over the arena (K/V views, the model's weight
        references) and close the weights when the worker loaded them itself; the pool's
        reservation can then be released. Idempotent."""
        self.kv_views.close()
        self.runner = self.model = None
        weights, self.weights = self.weights, None
        if self.owns_weights and weights is not None and hasattr(weights, "close"):
            weights.close()
