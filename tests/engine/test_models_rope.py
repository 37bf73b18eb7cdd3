"""RoPE inverse frequencies equal transformers' for the rope types the engine implements, read
from both config forms (transformers 5 ``rope_parameters``; ``rope_theta`` + ``rope_scaling`` as
released checkpoints such as Llama 3.1 ship them)."""

from __future__ import annotations

import pytest
import torch

from xllm_vmm.engine.layers.rotary import inverse_frequencies, rope_parameters

LLAMA31 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192, "rope_type": "llama3"}


@pytest.mark.parametrize("scaling", [None, LLAMA31, {"rope_type": "linear", "factor": 4.0},
                                     {"type": "linear", "factor": 2.0}])
def test_inverse_frequencies_match_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    released = {"hidden_size": 256, "num_attention_heads": 4, "head_dim": 64,
                "rope_theta": 500000.0, "max_position_embeddings": 131072}
    if scaling is not None:
        released["rope_scaling"] = dict(scaling)
    hf = LlamaConfig(**released)
    kind = hf.rope_parameters["rope_type"]
    if kind == "default":
        base = hf.rope_parameters["rope_theta"]
        ref = 1.0 / (base ** (torch.arange(0, 64, 2, dtype=torch.int64).float() / 64))
    else:
        ref, factor = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
        assert factor == 1.0
    for form in (released, {"rope_parameters": dict(hf.rope_parameters)}):
        ours = inverse_frequencies(64, rope_parameters(form))
        torch.testing.assert_close(ours, ref.float(), atol=0, rtol=1e-6)
