#!/usr/bin/env python
"""Kernel launches per transformer block, per configuration, in ONE table, with the 910B1 estimate next to them.

Usage (from the repo root)::

    .venv/bin/python benchmarks/bench_ops.py                 # the table (builds a real-width model)
    .venv/bin/python benchmarks/bench_ops.py --write-table   # also rewrite vllm_omni_ascend_opt/ablation/npu_launches.json
    .venv/bin/python benchmarks/bench_ops.py --json out.json

Columns, each launches per block of a warm forward (a repeated request; ``testbed/blockops.py``), B=1, CFG off:

* ``tiny fp32 CPU``: the tiny test-bed transformer in fp32, what the CPU dispatches (``testbed/opcount.py``; the op
  budget's unit: stock 106);
* ``tiny bf16 NPU`` / ``real bf16 NPU``: what torch_npu 2.13 would launch (``testbed/npu_ops.py``) with the semantic
  torch_npu fake installed (the plugin takes its NPU paths), on the tiny transformer and on a REAL-width one
  (hidden 3072, 24 heads x 128, 2 blocks, random weights) at 128x128 (64 image + 32 text tokens: the count per
  block does not depend on the sequence length, and 1280x704 = 3520 image tokens would take minutes per forward on
  2 cores);
* ``real bf16 CPU``: the real-width transformer without the fake, what the CPU dispatches (stock 126);
* ``est. ms saved``: the estimated ms saved per image on a 910B1 (model, not measured: ``ablation/estimate.py``),
  1280x704, 8 steps, CFG off, 60 blocks, from the launches the configuration removes per transformer call.

``--write-table`` counts every subset of the transformer optimizations through the fake at the tiny width (per
block and outside the blocks; stock, all and each optimization alone checked equal at real width) and writes the
table ``plan``'s estimate reads.
"""

from __future__ import annotations

import argparse
import itertools
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
    p.add_argument("--write-table", action="store_true", help="rewrite the estimate's launch table")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p.parse_args(argv)


def fake_torch_npu() -> Any:
    """The semantic torch_npu fake (tests/fake_torch_npu) installed for a ``with`` block."""
    from tests.fake_torch_npu import installed

    return installed()


def _opts(flags: str) -> tuple[str, ...]:
    from vllm_omni_ascend_opt import flags as flags_mod

    return tuple(flags_mod.parse_spec(flags))


def write_table(tr: Any, rt: Any, kw: dict[str, Any], tiny: Any, tiny_kw: dict[str, Any]) -> dict[str, Any]:
    """Count every subset of the transformer optimizations through the fake at the tiny width in bf16 (cheap: 2^n
    configurations), check stock, the full set and each optimization alone at REAL width (block and outside the
    blocks must agree: launch counts do not depend on the width), and write ``ablation/npu_launches.json``."""
    from vllm_omni_ascend_opt.ablation import estimate
    from vllm_omni_ascend_opt.testbed import blockops
    from vllm_omni_ascend_opt.testbed.npu_ops import wheel_header

    names = estimate.transformer_opts()
    entries: dict[str, dict[str, int]] = {}
    checked = {(), tuple(names), *((n,) for n in names)}
    with fake_torch_npu():
        for k in range(len(names) + 1):
            for subset in itertools.combinations(names, k):
                flags = ",".join(["none", *(f"+{n}" for n in subset)])
                small = blockops.count_block(tiny, rt, tiny_kw, flags, npu=True)
                if small.unresolved:
                    raise SystemExit(f"{flags}: ops without an NPU kernel or decomposition: {dict(small.unresolved)}")
                if subset in checked:
                    real = blockops.count_block(tr, rt, kw, flags, npu=True)
                    if (small.total, small.outside) != (real.total, real.outside):
                        raise SystemExit(
                            f"{flags}: tiny {small.total}/{small.outside} != real {real.total}/{real.outside} "
                            "launches per block / outside the blocks"
                        )
                entries[estimate.key(subset)] = {"block": small.total, "outside": small.outside}
    table = {
        "about": "launches per block and per transformer call outside the blocks, warm forward, in bf16, B=1, "
        "counted by testbed/npu_ops.NpuOpCounter with the torch_npu fake; every subset counted at the tiny width, "
        "stock / all / each optimization alone checked equal at REAL width (hidden 3072, 24 heads x 128) when "
        "written; key: the transformer optimizations, registry order, '+'-joined ('' = stock).",
        "generated_by": "benchmarks/bench_ops.py --write-table",
        "wheel": wheel_header(),
        "transformer_opts": names,
        "entries": entries,
    }
    estimate.TABLE_FILE.write_text(json.dumps(table, indent=1, sort_keys=False) + "\n")
    estimate.load_table.cache_clear()
    return table


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

    table = write_table(real, rt, kwr, tiny16, kw16) if args.write_table else None
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
    return {"build_s": round(build_s, 1), "configs": rows, "table_written": table is not None}


def report(res: dict[str, Any]) -> str:
    from vllm_omni_ascend_opt.ablation import estimate

    try:
        cal = estimate.calibration()
    except (ValueError, FileNotFoundError) as exc:
        cal = None
        why = str(exc)
    lines = [
        "bench_ops: kernel launches per transformer block, warm forward, B=1, CFG off (real width built in "
        f"{res['build_s']} s)",
        f"  {'config':<22} {'tiny fp32 CPU':>13} {'tiny bf16 NPU':>13} {'real bf16 NPU':>13} {'real bf16 CPU':>13} "
        f"{'est. ms saved':>13}",
    ]
    for name, row in res["configs"].items():
        ms = estimate.ms_saved(row["opts"], steps=8) if cal else None
        est = f"{ms:.0f}" if ms is not None else "n/a"
        lines.append(
            f"  {name:<22} {row['tiny_fp32_cpu']:>13} {row['tiny_bf16_npu']:>13} {row['real_bf16_npu']:>13} "
            f"{row['real_bf16_cpu']:>13} {est:>13}"
        )
    lines.append("")
    lines.append("NPU = what torch_npu 2.13 would launch (testbed/npu_ops.py), torch_npu fake installed; CPU = what")
    lines.append("the CPU dispatches (testbed/opcount.py). Views and allocation-only ops excluded.")
    if cal:
        lines.append(f"est. ms saved = {estimate.LABEL}: 1280x704, 8 steps, CFG off, 60 blocks; {cal.describe()}.")
    else:
        lines.append(f"est. ms saved: n/a ({why})")
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
