"""Speculative decoding with an MTP draft.

- :mod:`.mtp` — :class:`MtpDraft`, a DeepSeek-style multi-token-prediction module loaded from a
  draft directory in the format xllm's ``tools/export_mtp.py`` writes, over the ``"draft"``
  cache group;
- :mod:`.rejection` — greedy verification and the standard rejection-sampling rule;
- :mod:`.generator` — :class:`SpeculativeGenerator`: K proposals per sequence, verified by the
  target in one pass, over the KV cache manager (target and draft blocks allocated, mapped and
  released together, SD-01), with per-position acceptance statistics (lock-step rounds; the
  reference the engine's tests compare against);
- :mod:`.speculator` — :class:`MtpSpeculator`: the same inside ``LLMEngine``'s continuous
  batching (``--draft_model --speculative_algorithm=MTP --num_speculative_tokens=K``), with
  the rejected drafts' blocks given back at once and ``stats()["spec_decode"]``.
"""

from xllm_vmm.engine.spec_decode.generator import SpecDecodeStats, SpeculativeGenerator
from xllm_vmm.engine.spec_decode.mtp import MTP_ARCHITECTURES, MtpDraft
from xllm_vmm.engine.spec_decode.rejection import greedy_verify, rejection_sample
from xllm_vmm.engine.spec_decode.speculator import MtpSlotsKVManager, MtpSpeculator

__all__ = ["MTP_ARCHITECTURES", "MtpDraft", "MtpSlotsKVManager", "MtpSpeculator",
           "SpecDecodeStats", "SpeculativeGenerator", "greedy_verify", "rejection_sample"]
