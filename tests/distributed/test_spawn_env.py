"""Followers run the package rank 0 runs, wherever rank 0 was started: from a directory that
holds another ``xllm_vmm`` tree (a source checkout without its compiled libraries), the
follower's interpreter still imports rank 0's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from xllm_vmm.engine.distributed import spawn


@pytest.mark.skipif(sys.version_info < (3, 11), reason="-P is Python 3.11's")
def test_a_follower_started_from_a_checkout_imports_rank_0s_package(tmp_path):
    shadow = tmp_path / "xllm_vmm"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('the source tree, not rank 0s package')\n")
    code = "import xllm_vmm, os; print(os.path.dirname(os.path.dirname(xllm_vmm.__file__)))"
    out = subprocess.run([*spawn.follower_python(), "-c", code], cwd=tmp_path,
                         env=spawn.follower_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert os.path.realpath(out.stdout.strip()) == os.path.realpath(spawn.package_root())
    plain = subprocess.run([sys.executable, "-m", "xllm_vmm"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
    assert "the source tree" in plain.stderr  # what the follower met before


def test_spawn_uses_that_command_and_environment(monkeypatch):
    seen = {}

    class Popen:
        def __init__(self, args, env, **kw):
            seen["args"], seen["env"] = args, env

    monkeypatch.setattr(spawn.subprocess, "Popen", Popen)
    spawn.spawn_followers(2, 12345, "/m", {}, {})
    assert seen["args"][:len(spawn.follower_python())] == spawn.follower_python()
    assert seen["env"]["PYTHONPATH"].split(os.pathsep)[0] == spawn.package_root()
