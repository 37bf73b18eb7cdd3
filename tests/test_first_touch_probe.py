"""``scripts/first_touch_probe.py``: one line per size held, a clear usage error otherwise
(the figures themselves depend on the machine and are never asserted)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "first_touch_probe.py"


def test_probe_prints_one_line_per_size_held():
    r = subprocess.run([sys.executable, str(SCRIPT), "0", "0.05"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 2
    for held, line in zip(("0", "0.05"), lines):
        m = re.fullmatch(rf"{re.escape(held)} GB held: first touch (\d+\.\d\d) us/page "
                         r"\(again: (\d+\.\d\d)\)", line)
        assert m and float(m.group(1)) > 0 and float(m.group(2)) > 0, line


def test_probe_refuses_what_is_not_a_size():
    r = subprocess.run([sys.executable, str(SCRIPT), "4GB"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert "usage:" in r.stderr and "'4GB'" in r.stderr
