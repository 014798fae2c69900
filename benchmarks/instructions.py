"""Instructions per transformer forward, counted by valgrind's callgrind: a host-cost measure that no other process
on a shared machine can disturb, split into kernel arithmetic and everything else.

Why: ``bench_host.py`` times forwards on the CPU, where the kernels' arithmetic runs on the same thread as the host
work (Python, dispatch, allocation). On an NPU the arithmetic runs on the device, overlapped with the host; on the
2-core CPU it adds the same amount to stock and to every configuration and pulls their ratios towards 1. Even at the
tiny test-bed width it is not negligible: MKL's small GEMMs, the GELU's ``tanh`` and the attention kernel cost about
as much per call at 12 tokens as at 48. Thread-time on a shared virtual machine also drifts by tens of percent
between rounds. Instruction counts are exact and repeatable, and the functions that execute a kernel's arithmetic
(MKL, SLEEF, the vectorized loops and reductions, the CPU attention and norm kernels) can be told apart from the host
work by name.

How: one child process per configuration runs under ``valgrind --tool=callgrind --instr-atstart=no``; it builds the
model, warms it, switches instrumentation on (``callgrind_control -i on``) for ``n`` forwards and off again. A child
with no forward measures what the two switches cost, which is subtracted. ``callgrind_annotate`` gives the
instructions per function; :data:`KERNEL_SYMBOLS` names the kernel arithmetic. The split is by function name, so it is
an estimate of the host share, not a measurement of the NPU's host time; what is not arithmetic (interpreter,
dispatcher, TensorIterator set-up, allocator) is counted as host work.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

#: Substrings of the functions that execute kernel arithmetic (element loops, GEMM, reductions, attention, norms).
KERNEL_SYMBOLS = (
    "mkl_",
    "Sleef_",
    "cpu_flash_attention",
    "VectorizedLoop2d",
    "vectorized_",
    "Vectorized<",
    "RowwiseMoments",
    "LayerNormKernelImpl",
    "basic_loop",
    "serial_for_each",
    "DimCounter",
    "InnerSum",
    "cpu_kernel",
    "_kernel_impl",
)
_LINE = re.compile(r"^\s*([\d,]+) \(\s*[\d.]+%\)\s+(.*)$")


def missing_tools() -> str | None:
    """Why instructions cannot be counted here (None when valgrind's tools are on PATH)."""
    lacking = [t for t in ("valgrind", "callgrind_control", "callgrind_annotate") if shutil.which(t) is None]
    return f"{', '.join(lacking)} not found on PATH (install valgrind)" if lacking else None


def measured(n: int, forward: Callable[[], Any]) -> None:
    """In a child under callgrind: run ``forward`` ``n`` times with instrumentation on (and nothing else)."""
    pid = str(os.getpid())
    subprocess.run(["callgrind_control", "-i", "on", pid], capture_output=True, check=False)
    for _ in range(n):
        forward()
    subprocess.run(["callgrind_control", "-i", "off", pid], capture_output=True, check=False)


def split(out_file: Path) -> tuple[int, int]:
    """(all instructions, kernel arithmetic instructions) of one callgrind output file."""
    text = subprocess.run(
        ["callgrind_annotate", "--inclusive=no", "--threshold=100", str(out_file)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return parse(text)


def parse(text: str) -> tuple[int, int]:
    """(all instructions, kernel arithmetic instructions) from ``callgrind_annotate --inclusive=no`` output: the sum
    of the per-function counts (not the PROGRAM TOTALS line), and of those whose name holds a :data:`KERNEL_SYMBOLS`
    entry."""
    total = kernel = 0
    for line in text.splitlines():
        m = _LINE.match(line)
        if m is None or "PROGRAM TOTALS" in m.group(2):
            continue
        n = int(m.group(1).replace(",", ""))
        total += n
        if any(s in m.group(2) for s in KERNEL_SYMBOLS):
            kernel += n
    return total, kernel


def count(child_argv: Callable[[str, int], Sequence[str]], configs: dict[str, str], n: int) -> dict[str, Any]:
    """Instructions per forward of each configuration (``name -> flags``): ``child_argv(flags, n)`` is the command
    of a child that calls :func:`measured`. Returns per name: ``total``, ``kernel``, ``host`` (per forward), and the
    cost of the switches that was subtracted (``"switches"``)."""
    jobs = {"": ("none", 0), **{name: (flags, n) for name, flags in configs.items()}}
    with tempfile.TemporaryDirectory(prefix="bench-instr-") as tmp:

        def one(name: str) -> tuple[int, int]:
            flags, forwards = jobs[name]
            out = Path(tmp) / f"callgrind-{list(jobs).index(name)}.out"
            cmd = [
                "valgrind",
                "--tool=callgrind",
                "--instr-atstart=no",
                f"--callgrind-out-file={out}",
                *child_argv(flags, forwards),
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0 or not out.exists():
                tail = "\n".join(proc.stderr.splitlines()[-15:])
                raise SystemExit(f"--instructions: the child for {name or 'the switches'} failed:\n{tail}")
            return split(out)

        with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
            results = dict(zip(jobs, pool.map(one, jobs), strict=True))
    base_total, base_kernel = results.pop("")
    rows: dict[str, Any] = {"switches": base_total}
    for name, (total, kernel) in results.items():
        total_fwd = (total - base_total) / n
        kernel_fwd = (kernel - base_kernel) / n
        rows[name] = {"total": total_fwd, "kernel": kernel_fwd, "host": total_fwd - kernel_fwd}
    return rows


def report(rows: dict[str, Any], reference: str = "stock") -> list[str]:
    """Lines of a table: millions of instructions per forward, and each column's ratio to ``reference``."""
    ref = rows[reference]
    lines = [
        f"  {'config':<18} {'Minstr/fwd':>10} {'ratio':>6} {'kernel arithmetic':>17} {'host Minstr':>11} "
        f"{'host ratio':>10}"
    ]
    for name, r in rows.items():
        if name == "switches":
            continue
        lines.append(
            f"  {name:<18} {r['total'] / 1e6:>10.2f} {r['total'] / ref['total']:>6.3f} "
            f"{r['kernel'] / 1e6:>10.2f} ({r['kernel'] / r['total'] * 100:>3.0f}%) {r['host'] / 1e6:>11.2f} "
            f"{r['host'] / ref['host']:>10.3f}"
        )
    return lines


if __name__ == "__main__":  # pragma: no cover - a library for bench_host.py
    sys.exit("use benchmarks/bench_host.py --instructions")
