#!/usr/bin/env python3
"""What this machine charges for memory written for the first time, with N GB of another,
paused process resident beside it: what an elastic KV cache pays for every page it maps while
it grows, and why ``bench serve --vllm-venv`` keeps one server on the machine at a time
(``--residency exclusive``; ``docs/benchmarks.md``, "Residency").

    python scripts/first_touch_probe.py 0 2 4 6      # GB held by the paused process per line

Per line: microseconds per 4 KiB page to write 512 MiB of fresh anonymous memory (mapped,
one byte written per page, unmapped), and the same again right after. On a machine with
memory to spare both are ~2 us. On the 2-vCPU VM of these benches (its host backs guest memory
lazily) the first pass stayed at 1.7 us with up to 3 GB held and cost 53-56 us with 4-6 GB held
(16 us with 3 GB in another run), while the second pass, which gets the pages the first one
just gave back, stayed at 1.6-2.0 us. Only the standard library; the holder is a child
process, killed after each line.
"""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import time

HOLD = """import sys
b = bytearray(int(float(sys.argv[1]) * (1 << 30)))
for i in range(0, len(b), 4096):
    b[i] = 1
print("held", flush=True)
sys.stdin.read()
"""


def touch_us_per_page(mib: int = 512) -> float:
    size = mib << 20
    m = mmap.mmap(-1, size)
    try:
        t0 = time.perf_counter()
        for off in range(0, size, 4096):
            m[off] = 1
        return (time.perf_counter() - t0) / (size // 4096) * 1e6
    finally:
        m.close()


def main(argv: list[str]) -> int:
    try:
        sizes = [float(a) for a in argv] or [0.0, 2.0, 4.0]
    except ValueError:
        print(f"usage: {sys.argv[0]} GB [GB ...]  (GB held by a paused process; numbers, got "
              f"{' '.join(argv)!r})", file=sys.stderr)
        return 2
    for gb in sizes:
        holder = None
        if gb > 0:
            holder = subprocess.Popen([sys.executable, "-c", HOLD, str(gb)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            if holder.stdout.readline().strip() != "held":
                print(f"{gb:g} GB: the holder could not allocate it", file=sys.stderr)
                holder.kill()
                return 1
            os.kill(holder.pid, signal.SIGSTOP)
        try:
            first, again = touch_us_per_page(), touch_us_per_page()
        finally:
            if holder is not None:
                holder.kill()
                holder.wait()
        print(f"{gb:g} GB held: first touch {first:.2f} us/page (again: {again:.2f})",
              flush=True)
        time.sleep(1.0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
