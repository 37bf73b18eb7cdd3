"""``ModelRunner``: one step of a model over the paged KV cache.

``execute(step)`` moves the step's index tensors to the device, lets the attention backend
derive its per-step metadata once, runs every layer (new K/V written into their blocks, then
attention over each sequence's blocks), and returns float32 logits for the sampled rows only
(chunk order), the final-normed hidden states of the same rows (an MTP draft's input), and the step's execution peak.

Execution peak (bytes of transient device memory beyond weights and KV, what
``VmmPool.observe_execution_peak`` wants): measured on CUDA (``torch.cuda.max_memory_allocated``
over the step, minus what was allocated before it); elsewhere the upper bound
:func:`execution_peak_estimate` — two live ``(T, hidden)`` residual streams, the q/k/v
projections, the widest MLP intermediate (gate, up and their product), the attention backend's
largest gather + score workspace of one layer, and the float32 logits of the sampled rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from xllm_vmm.engine.attention.base import AttentionBackend
    from xllm_vmm.engine.attention.kv import KVCacheViews
    from xllm_vmm.engine.models.decoder import CausalLM
    from xllm_vmm.engine.step import StepInput, StepOutput


def execution_peak_estimate(model: CausalLM, backend: AttentionBackend, meta: Any,
                            num_tokens: int, num_sampled: int,
                            terms: tuple[int, int, int] | None = None) -> int:
    """Upper bound, in bytes, of one step's transient memory (see the module docstring).
    ``terms``: :func:`peak_terms` of ``model`` when the caller keeps them (they depend on the
    model only)."""
    per_token, per_sampled, elem = terms if terms is not None else peak_terms(model)
    return (num_tokens * per_token + backend.workspace_bytes(meta, elem)
            + num_sampled * per_sampled)


def peak_terms(model: CausalLM) -> tuple[int, int, int]:
    """The model's terms of :func:`execution_peak_estimate`: bytes per computed token, bytes
    per sampled row, and the element size (bytes) of its activations."""
    cfg = model.config
    elem = model.dtype.itemsize
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    sparse = [getattr(model, "sparse", False) and cfg.is_sparse_layer(i)
              for i in range(cfg.num_layers)]
    inter = cfg.intermediate_size if not all(sparse) else 0  # a dense layer's MLP
    if any(sparse):  # the routed experts' intermediates of every token (top-k of them)
        inter = max(inter, cfg.moe_intermediate_size * cfg.num_experts_per_tok)
    per_token = (2 * cfg.hidden_size + qkv + cfg.num_heads * cfg.head_dim + 3 * inter) * elem
    return per_token, cfg.vocab_size * 4 + cfg.hidden_size * elem, elem


class _ReadOnlyKV:
    """A backend whose ``write_kv`` does nothing (``StepInput.write_kv`` False): the step's
    K/V already sit in their blocks; everything else is the wrapped backend's."""

    def __init__(self, backend: AttentionBackend) -> None:
        self._backend = backend

    def write_kv(self, *args: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


class ModelRunner:
    """Runs :class:`~xllm_vmm.engine.models.decoder.CausalLM` steps over ``kv`` views."""

    def __init__(self, model: CausalLM, kv: KVCacheViews, backend: AttentionBackend,
                 device: Any, *, check_loaded: Any = None) -> None:
        self.model = model
        self.kv = kv
        self.backend = backend
        self.device = device
        self._check_loaded = check_loaded
        self.last_execution_peak = 0
        self._dev: Any = None  # torch.device(device), made on the first step
        self._peak_terms: tuple[int, int, int] | None = None  # peak_terms(model), likewise

    def execute(self, step: StepInput) -> StepOutput:
        import torch

        from xllm_vmm.engine.step import StepOutput

        if step.block_size != self.kv.geometry.block_size:
            raise ValueError(f"step built with block_size {step.block_size}, the KV cache has "
                             f"{self.kv.geometry.block_size}")
        if self._check_loaded is not None:
            self._check_loaded()  # weights asleep: a typed error, never garbage
        dev = self._dev
        if dev is None:
            dev = self._dev = torch.device(self.device)
        cuda = dev.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
        with torch.inference_mode():
            meta = self.backend.prepare(step)
            ids = step.input_ids.to(dev, non_blocking=True)
            pos = step.positions.to(dev, non_blocking=True)
            backend = self.backend
            if not step.write_kv:
                if any(c.start_pos for c in step.chunks) or hasattr(self.model, "make_kv"):
                    raise ValueError("a read-only step (write_kv=False) runs chunks from position "
                                     "0 on the standard decoder only")
                backend = _ReadOnlyKV(backend)
            hidden = self.model.forward(ids, pos, self.kv.layers, backend, meta)
            num_tokens, num_sampled = step.num_tokens, step.num_sampled
            if num_sampled == num_tokens:  # every row, in order (a decode step): no gather
                normed = self.model.final_hidden(hidden)
            else:
                normed = self.model.final_hidden(hidden[step.sample_indices.to(dev)])
            logits = self.model.logits(normed)
            lp_chunks = [c for c in step.chunks if c.prompt_logprobs]
            prompt_lps = self._prompt_logprobs(step, hidden) if lp_chunks else None
        if cuda:
            peak = int(torch.cuda.max_memory_allocated(dev) - base)
        else:
            extra = sum(len(c.token_ids) for c in lp_chunks)
            if self._peak_terms is None:
                self._peak_terms = peak_terms(self.model)
            peak = execution_peak_estimate(self.model, self.backend, meta, num_tokens,
                                           num_sampled + 2 * extra, self._peak_terms)
        self.last_execution_peak = peak
        return StepOutput(logits=logits, hidden_states=normed, execution_peak_bytes=peak,
                          prompt_logprobs=prompt_lps)

    def _prompt_logprobs(self, step: StepInput, hidden: Any) -> dict[str, Any]:
        """Float32 log-softmax of the raw logits of every row of the chunks that ask for it
        (``SeqChunk.prompt_logprobs``), per request id, on the CPU."""
        import torch

        out: dict[str, Any] = {}
        qsl = step.query_start_loc.tolist()
        for i, c in enumerate(step.chunks):
            if c.prompt_logprobs:
                lg = self.model.logits(self.model.final_hidden(hidden[qsl[i]:qsl[i + 1]]))
                out[c.request_id] = torch.log_softmax(lg, dim=-1).cpu()
        return out
