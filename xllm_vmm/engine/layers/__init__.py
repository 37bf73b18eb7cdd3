"""Shared layers of the engine's model families (plain functions and small classes over
tensors the caller owns; no ``torch.nn.Module``, no parameter copies).

Every layer *references* the weight tensors it is given (they may view the VMM arena, so their
addresses must stay valid across sleep / wakeup: nothing here copies or re-allocates a weight).

- :mod:`.parallel` — :class:`TensorParallel` (rank, world size; the seam of tensor parallelism);
- :mod:`.linear` — :class:`ColumnParallelLinear`, :class:`RowParallelLinear`,
  :class:`ReplicatedLinear`;
- :mod:`.norm` — :func:`rms_norm`, :class:`RMSNorm`;
- :mod:`.rotary` — :class:`RotaryEmbedding` (default, linear, llama3 scaling);
- :mod:`.mlp` — :class:`GatedMLP` (SiLU-gated feed-forward);
- :mod:`.moe` — :class:`SparseMoE` (top-k experts, Qwen3-MoE routing);
- :mod:`.embedding` — :class:`VocabEmbedding`, :class:`LMHead`.
"""

from xllm_vmm.engine.layers.embedding import LMHead, VocabEmbedding
from xllm_vmm.engine.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from xllm_vmm.engine.layers.mlp import GatedMLP
from xllm_vmm.engine.layers.moe import SparseMoE
from xllm_vmm.engine.layers.norm import RMSNorm, rms_norm
from xllm_vmm.engine.layers.parallel import TensorParallel
from xllm_vmm.engine.layers.rotary import RopeConfigError, RotaryEmbedding

__all__ = [
    "ColumnParallelLinear", "GatedMLP", "LMHead", "RMSNorm", "ReplicatedLinear",
    "RopeConfigError", "RotaryEmbedding", "RowParallelLinear", "SparseMoE", "TensorParallel",
    "VocabEmbedding", "rms_norm",
]
