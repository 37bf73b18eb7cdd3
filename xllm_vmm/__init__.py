"""xllm-vmm: an LLM server whose KV cache and weights live in a virtual-memory (VMM) pool.

Importing the package is cheap: nothing here imports torch, pydantic or the native libraries.
"""

__version__ = "0.1.0"
