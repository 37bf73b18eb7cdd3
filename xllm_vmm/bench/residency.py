"""Which servers or engines stay in memory while a comparison bench measures one of them.

``exclusive`` (the default of ``bench serve --vllm-venv`` and ``bench engine --vllm-venv``):
only the one being measured is resident; vLLM's is started for each of its runs and stopped
after it. ``shared``: vLLM stays up for the whole bench, paused (SIGSTOP) while the others run.

Why exclusive: on the 2-vCPU virtual machine these benches run on, the host backs guest memory
lazily. With ~4 GB more of the guest in use — an idle ``vllm serve`` is 4.5 GB of processes
and its 2 GiB of KV, paused or not — writing a page for the first time cost 16-56 us instead of
2 us, and every page an elastic KV cache maps while it grows is one. Beside a paused vLLM our
server's TPOT went from 12-16 ms to 38-44 ms; with the KV cache mapped up front
(``--vmm_elastic=false``) a paused 7 GB process changed nothing. vLLM commits its KV space at
start-up and does not feel it (``docs/benchmarks.md``, "Residency").
"""

from __future__ import annotations

RESIDENCIES = ("exclusive", "shared")

__all__ = ["RESIDENCIES"]
