#!/usr/bin/env python
"""Kernel launches per transformer block, per configuration, in ONE table.

Usage (from the repo root)::

    .venv/bin/python benchmarks/bench_ops.py                 # the table (builds a real-width model)
    .venv/bin/python benchmarks/bench_ops.py --json out.json

Columns, each launches per block of a warm forward (a repeated request; ``testbed/blockops.py``), B=1, CFG off:

* ``tiny fp32 CPU``: the tiny test-bed transformer in fp32, what the CPU dispatches (``testbed/opcount.py``; the op
  budget's unit: stock 106);
* ``tiny bf16 NPU`` / ``real bf16 NPU``: what torch_npu 2.13 would launch (``testbed/npu_ops.py``) with the semantic
  torch_npu fake installed (the plugin takes its NPU paths), on the tiny transformer and on a REAL-width one
  (hidden 3072, 24 heads x 128, 2 blocks, random weights) at 128x128 (64 image + 32 text tokens: the count per
  block does not depend on the sequence length, and 1280x704 = 3520 image tokens would take minutes per forward on
  2 cores);
* ``real bf16 CPU``: the real-width transformer without the fake, what the CPU dispatches (stock 126).

What the launches cost on a 910B1 is the device-time model's (``devtime/``, ``benchmarks/bench_devtime.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p.parse_args(argv)


def fake_torch_npu() -> Any:
    """The semantic torch_npu fake (tests/fake_torch_npu) installed for a ``with`` block."""
    from tests.fake_torch_npu import installed

    return installed()


def _opts(flags: str) -> tuple[str, ...]:
    from vllm_omni_ascend_opt import flags as flags_mod

    return tuple(flags_mod.parse_spec(flags))


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from vllm_omni_ascend_opt.testbed import blockops
    from vllm_omni_ascend_opt.testbed.runtime import init_cpu_runtime

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    rt = init_cpu_runtime(None, dtype=torch.float32)
    bf16 = torch.bfloat16
    tiny32 = blockops.build_transformer(rt, blockops.TINY, torch.float32)
    tiny16 = blockops.build_transformer(rt, blockops.TINY, bf16)
    t0 = time.perf_counter()
    real = blockops.build_transformer(rt, blockops.REALWIDTH, bf16)
    build_s = time.perf_counter() - t0
    kw32, kw16, kwr = (blockops.t2i_inputs(m, d) for m, d in ((tiny32, torch.float32), (tiny16, bf16), (real, bf16)))

    rows: dict[str, dict[str, Any]] = {}
    configs = blockops.configurations()
    for name, flags in configs.items():
        rows[name] = {
            "flags": flags,
            "tiny_fp32_cpu": blockops.count_block(tiny32, rt, kw32, flags, npu=False).total,
            "real_bf16_cpu": blockops.count_block(real, rt, kwr, flags, npu=False).total,
        }
    with fake_torch_npu():
        for name, flags in configs.items():
            rows[name]["opts"] = list(_opts(flags))  # with the fake: the NPU-only optimizations are selectable
            rows[name]["tiny_bf16_npu"] = blockops.count_block(tiny16, rt, kw16, flags, npu=True).total
            r = blockops.count_block(real, rt, kwr, flags, npu=True)
            rows[name]["real_bf16_npu"] = r.total
            rows[name]["real_bf16_npu_outside"] = r.outside
    return {"build_s": round(build_s, 1), "configs": rows}


def report(res: dict[str, Any]) -> str:
    lines = [
        "bench_ops: kernel launches per transformer block, warm forward, B=1, CFG off (real width built in "
        f"{res['build_s']} s)",
        f"  {'config':<22} {'tiny fp32 CPU':>13} {'tiny bf16 NPU':>13} {'real bf16 NPU':>13} {'real bf16 CPU':>13}",
    ]
    for name, row in res["configs"].items():
        lines.append(
            f"  {name:<22} {row['tiny_fp32_cpu']:>13} {row['tiny_bf16_npu']:>13} {row['real_bf16_npu']:>13} "
            f"{row['real_bf16_cpu']:>13}"
        )
    lines.append("")
    lines.append("NPU = what torch_npu 2.13 would launch (testbed/npu_ops.py), torch_npu fake installed; CPU = what")
    lines.append("the CPU dispatches (testbed/opcount.py). Views and allocation-only ops excluded.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    res = run(args)
    print(report(res), flush=True)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
