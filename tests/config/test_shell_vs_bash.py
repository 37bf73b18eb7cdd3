"""The launch command as xllm-vmm reads it equals the argv bash gives the program: each script
runs under bash with a stub ``xllm`` that records its arguments, and parse_shell's tokens must
be the same words (skipped where bash is not installed)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from xllm_vmm.config.sources import parse_shell

BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="needs bash")

SCRIPTS = [
    'xllm --port=8000 --model="/m x"\n',
    "START=18000\nfor (( i=0; i<4; i++ ))\ndo\n  PORT=$((START + i))\n  DEVICE=$((0 + i))\n"
    '  xllm --port $PORT --devices="npu:$DEVICE" --node_rank=$i \\ > /dev/null 2>&1\n'
    "  break\ndone\n",
    "A=6\nB=$(( A * 7 % 5 - -3 ))\nxllm --x=$B --y=$(( (A << 2) | 1 ))\n",
    'P="--a=1 --b=2"\nxllm $P "$P" --c=${P:-no}\n',
    "X=\nxllm --u=${X:-dflt} --v=${X-set} --w=${UNSET_HERE:+alt}end\n",
    "export N=3\nreadonly M=$N$N\nxllm --n=$N --m=$M --q='$N' --r=\"$N\"\n",
    "xllm --port=8000>/dev/null --k=v;echo x >/dev/null\n",
    "xllm   --a=1 \\\n   --b=2 \\\n   --c=\"x\\\"y\"\n",
    "for d in 5 6; do xllm --devices=npu:$d; break; done\n",
    "LOCAL=16\ni=0\nxllm --node_rank=$((i + LOCAL)) --z=$((LOCAL*40))-$((LOCAL*40+39))\n",
    "V='a b'\nxllm --s=$V\n",
    "xllm --e='' --f=\"\" -- g\n",
]


def bash_argv(text: str, tmp_path: Path) -> list[str]:
    stub = tmp_path / "xllm"
    out = tmp_path / "argv.json"
    stub.write_text(f"#!{sys.executable}\nimport json, sys\n"
                    f"open({str(out)!r}, 'w').write(json.dumps(sys.argv[1:]))\n")
    stub.chmod(0o755)
    script = tmp_path / "s.sh"
    script.write_text(text)
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ.get('PATH', '')}")
    env.pop("UNSET_HERE", None)
    subprocess.run([BASH, str(script)], env=env, cwd=tmp_path, check=False, timeout=30,
                   capture_output=True)
    return json.loads(out.read_text())


@pytest.mark.parametrize("text", SCRIPTS, ids=range(len(SCRIPTS)))
def test_tokens_are_the_argv_bash_passes(text, tmp_path):
    shell, findings = parse_shell(text, "s.sh")
    assert shell is not None, findings
    ours = [t.text for t in shell.tokens]
    theirs = [a for a in bash_argv(text, tmp_path) if a.strip()]  # blank words: a note here
    assert ours == theirs
