"""``XLLM_VMM_CHECK_WEIGHTS=finite``: a weight holding NaN or inf stops the load with one error
naming the tensor (nothing stays allocated); unset, the same checkpoint loads as it is; serve
ends in one line, exit 1."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from tests.weights.conftest import random_tensors, save_checkpoint  # noqa: E402
from xllm_vmm.weights import CheckpointError, load_weights  # noqa: E402
from xllm_vmm.weights.loader import CHECK_ENV, check_finite_wanted  # noqa: E402

BAD = "model.layers.1.mlp.down_proj.weight"


def _poisoned(tmp_path, value=float("nan")):
    sd = random_tensors("bfloat16")
    sd[BAD][3, 5] = value
    return save_checkpoint(tmp_path / "m", sd)


@pytest.mark.parametrize("with_pool", [False, True])
@pytest.mark.parametrize("value", [float("nan"), float("-inf")])
def test_a_non_finite_weight_stops_the_load_naming_the_tensor(tmp_path, stack, monkeypatch,
                                                              with_pool, value):
    model = _poisoned(tmp_path, value)
    pool = stack()[1] if with_pool else None
    monkeypatch.setenv(CHECK_ENV, "finite")
    with pytest.raises(CheckpointError) as e:
        load_weights(model, pool=pool)
    msg = str(e.value)
    assert repr(BAD) in msg and "1 non-finite value(s)" in msg and str(model) in msg
    assert ("(1 NaN)" if value != value else "(0 NaN)") in msg
    if pool is not None:
        assert pool.held_bytes == 0 and not pool.has_tenant("weights")
    monkeypatch.setenv(CHECK_ENV, "0")
    w = load_weights(model, pool=pool)  # unchecked: loaded as it is
    assert torch.isnan(w[BAD]).any() or torch.isinf(w[BAD]).any()
    w.close()


def test_the_setting_is_checked():
    assert not check_finite_wanted({}) and check_finite_wanted({CHECK_ENV: "finite"})
    with pytest.raises(ValueError, match=f"{CHECK_ENV}='maybe'"):
        check_finite_wanted({CHECK_ENV: "maybe"})


def test_serve_with_the_check_is_one_line_naming_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    from xllm_vmm.engine.demo import demo_model_dir

    model = tmp_path / "nan-demo"
    shutil.copytree(demo_model_dir(), model)
    sd = load_file(str(model / "model.safetensors"))
    name = sorted(n for n in sd if n.endswith("mlp.up_proj.weight"))[0]
    sd[name][0, 0] = float("nan")
    save_file(sd, str(model / "model.safetensors"))
    proc = subprocess.run([sys.executable, "-m", "xllm_vmm.cli", "serve", "--model", str(model),
                           "--port", "0", "--device-memory=128MiB", "--max-model-len=64"],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **{CHECK_ENV: "finite"}))
    assert proc.returncode == 1, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
    assert len(errors) == 1 and repr(name) in errors[0] and "non-finite" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and "ready" not in proc.stdout
