"""Build of the native libraries in ``native/`` (the rest of the metadata is in pyproject.toml).

The C code is not a CPython extension module: it is a plain shared library that
``xllm_vmm.vmm.native`` loads with ctypes (so it does not depend on the Python ABI, and the ACL
emulation keeps the exact ``libascendcl`` symbol names). setuptools' ``Extension`` machinery
compiles it with the system C compiler (gcc); ``build_ext`` below only drops the
``.cpython-3xx-...`` suffix from the file names, so the libraries are ``libxllm_hostvmm.so`` and
``libascendcl_emu.so`` inside the ``xllm_vmm/vmm`` package directory, both for ``pip install .``
(in the wheel) and for ``pip install -e .`` (setuptools copies built extensions into the source
tree in editable mode).
"""

from __future__ import annotations

import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CFLAGS = ["-O2", "-std=gnu11", "-fvisibility=default", "-Wall", "-Wno-unused-result", "-Wno-format-truncation"]
if os.environ.get("XLLM_VMM_NATIVE_SANITIZE"):
    # e.g. XLLM_VMM_NATIVE_SANITIZE=address: instrumented build for the native tests
    CFLAGS += [f"-fsanitize={os.environ['XLLM_VMM_NATIVE_SANITIZE']}", "-g", "-fno-omit-frame-pointer"]


class build_plain_shared_libs(build_ext):
    """Builds ctypes-loaded libraries: ``<name>.so`` instead of ``<name>.cpython-...so``, and
    no ``PyInit_*`` export is expected."""

    def get_ext_filename(self, fullname: str) -> str:
        return os.path.join(*fullname.split(".")) + ".so"

    def get_export_symbols(self, ext: Extension) -> list[str]:
        return []


def _lib(name: str, sources: list[str]) -> Extension:
    return Extension(
        f"xllm_vmm.vmm.{name}",
        sources=sources,
        depends=["native/hostvmm.h", "native/threadpool.h"],
        include_dirs=["native"],
        extra_compile_args=CFLAGS,
        extra_link_args=["-lpthread"],
        define_macros=[("_GNU_SOURCE", "1")],
    )


setup(
    ext_modules=[
        _lib("libxllm_hostvmm", ["native/hostvmm.c"]),
        _lib("libascendcl_emu", ["native/acl_emu.c", "native/hostvmm.c"]),
        _lib("libxllm_paged_attn", ["native/paged_attn.c"]),  # engine.attention.native_decode
        _lib("libxllm_layer_ops", ["native/layer_ops.c"]),  # engine.layers.layer_ops
        _lib("libxllm_kvtable", ["native/kvtable.c"]),  # kvcache.kvtable (block tables)
    ],
    cmdclass={"build_ext": build_plain_shared_libs},
)
