#!/usr/bin/env python
"""Where the time goes on the device at full scale: the device-time model's tables (a MODEL, not a measurement).

Usage (from the repo root)::

    .venv/bin/python benchmarks/bench_devtime.py --write-table   # trace every workload x configuration, write
                                                                 # vllm_omni_ascend_opt/devtime/devtime_table.json.gz
    .venv/bin/python benchmarks/bench_devtime.py                 # print the tables from the committed table
    .venv/bin/python benchmarks/bench_devtime.py --cards 2,4,8   # and the multi-card layouts

The trace (``devtime/trace.py``) runs vLLM-Omni's real Qwen-Image transformer (real width, 60 blocks as first +
59 x last) and real VAE decoder on CPU with nothing computed, with the semantic torch_npu fake installed so the
plugin takes its NPU paths; the model (``devtime/model.py``) is fitted on the reference's published figures and
prints each calibration point's residual. Per resolution: predicted ms per image for each configuration and as a
multiple of the compute floor, and the top ops of the default stack that are neither GEMMs nor attention.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def fake_torch_npu() -> Any:
    """The semantic torch_npu fake (tests/fake_torch_npu) installed for a ``with`` block."""
    from tests.fake_torch_npu import installed

    return installed()


def write_table() -> float:
    import torch

    from vllm_omni_ascend_opt.devtime import table as TB
    from vllm_omni_ascend_opt.testbed import tiny_model
    from vllm_omni_ascend_opt.testbed.runtime import init_cpu_runtime

    torch.set_num_threads(2)
    rt = init_cpu_runtime(str(tiny_model.build_model_dir(tiny_model.TINY)))
    t0 = time.perf_counter()
    with fake_torch_npu():
        n = len(TB.RESOLUTIONS) * len(TB.BATCHES) * len(TB.configurations())
        done = [0]

        def progress(what: str) -> None:
            done[0] += 1
            print(f"\r  traced {done[0]}/{n} {what:<40}", end="", file=sys.stderr, flush=True)

        table = TB.build(rt, progress=progress)
    print(file=sys.stderr)
    TB.write(table)
    return time.perf_counter() - t0


def markdown(steps: int) -> str:
    """docs/device-model.md's device-time tables, from the committed trace table."""
    from vllm_omni_ascend_opt.devtime import layouts as L
    from vllm_omni_ascend_opt.devtime import report
    from vllm_omni_ascend_opt.devtime import table as TB

    table = TB.load(TB.TABLE_FILE)
    fit = report.calibration(table)
    p = fit.params
    out = [
        f"Fitted: {p.describe()}.",
        "",
        "| calibration point | published ms | model ms | residual | |",
        "|---|---|---|---|---|",
    ]
    for name, (ref, got, res, used) in fit.points.items():
        out.append(f"| {name} | {ref:.1f} | {got:.1f} | {res:+.1f} | {'fit' if used else 'held out'} |")
    res = [(h, w) for h, w in TB.RESOLUTIONS]
    cols = ["stock", "default", "all", "portable"]
    out += ["", f"Predicted ms per image (model), {steps} steps, B=1, CFG off (x compute floor in brackets):", ""]
    out.append("| resolution | floor ms | " + " | ".join(cols) + " | B=2 default |")
    out.append("|---" * (len(cols) + 3) + "|")
    for h, w in res:
        preds = report.predictions(table, p, TB.workload_key(h, w, 1), steps)
        b2 = report.predictions(table, p, TB.workload_key(h, w, 2), steps)["default"]
        cells = [f"{preds[c].image_ms:.0f} (x{preds[c].image_ms / preds[c].floor_ms:.2f})" for c in cols]
        out.append(f"| {w}x{h} | {preds['stock'].floor_ms:.0f} | " + " | ".join(cells) + f" | {b2.image_ms:.0f} |")
    alone = [n for n in TB.configurations() if n in TB.transformer_names() + TB.vae_names()]
    out += ["", f"Each optimization alone: predicted ms saved per image against stock (model), {steps} steps, B=1:", ""]
    out.append("| optimization | " + " | ".join(f"{w}x{h}" for h, w in res) + " |")
    out.append("|---" * (len(res) + 1) + "|")
    for n in alone:
        cells = []
        for h, w in res:
            preds = report.predictions(table, p, TB.workload_key(h, w, 1), steps)
            cells.append(f"{preds['stock'].image_ms - preds[n].image_ms:.0f}")
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    wk = TB.workload_key(1328, 1328, 1)
    step = report.predictions(table, p, wk, steps)["default"].transformer_ms
    out += ["", f"Top 10 ops of the default stack that are neither GEMMs nor attention, 1328x1328, {steps} steps:", ""]
    out += ["| ms per image | % of a default step | op | launches | GB | where |", "|---|---|---|---|---|---|"]
    for r in report.top_ops(table, p, wk, "default", "transformer", 10, steps):
        share = 100 * r["ms"] / steps / step
        out.append(
            f"| {r['ms']:.1f} | {share:.1f} | `{r['op']}` | {r['launches']} | {r['gbytes']:.1f} | `{r['site']}` |"
        )
    out += ["", "The same for one VAE decode (default), 1328x1328:", "", "| ms | op | launches | GB | where |"]
    out.append("|---|---|---|---|---|")
    for r in report.top_ops(table, p, wk, "default", "vae", 10, 1):
        out.append(f"| {r['ms']:.1f} | `{r['op']}` | {r['launches']} | {r['gbytes']:.1f} | `{r['site']}` |")
    for h, w, cfg in ((1024, 1024, True), (704, 1280, False)):
        out += ["", "```", *L.text_table(table, p, h, w, steps, [2, 4, 8], cfg), "```"]
    out += ["", "```", *published_checks(table, p), "```"]
    return "\n".join(out)


def calibration_lines(fit: Any) -> list[str]:
    """The fitted parameters and each calibration point's residual."""
    from vllm_omni_ascend_opt.devtime import model as M

    return [f"  calibration ({M.LABEL}): {fit.params.describe()}", *(f"    {r}" for r in fit.rows())]


def published_checks(table: dict[str, Any], params: Any) -> list[str]:
    """The model against the published multi-card figures (vLLM-Omni #3188, #4118; 910B3, 1024x1024). Assumed:
    50 steps (the pipeline's default), CFG off (no negative prompt in the issue's requests), stock code."""
    from vllm_omni_ascend_opt.devtime import layouts as L

    b3 = params.on("910B3")
    one = L.predict(table, b3, L.Layout(), "stock", 1024, 1024, 50, 1)["ms"]
    usp = L.predict(table, b3, L.Layout(ulysses=2), "stock", 1024, 1024, 50, 1)["ms"]
    tp = L.predict(table, b3, L.Layout(tp=2), "stock", 1024, 1024, 50, 1)["ms"]
    tp85 = L.predict(table, b3, L.Layout(tp=2), "stock", 1024, 1024, 50, 1, latency_us=85e3)["ms"]
    return [
        f"  published multi-card figures against the model ({L.M.LABEL}; 910B3 = the 910B1 fit at 910B3's peak; "
        "1024x1024, 50 steps, CFG off, stock):",
        f"    1 card: published ~26.6 s (#3188), model {one / 1e3:.1f} s",
        f"    USP2: published about 2x (#4118), model x{one / usp:.2f}",
        f"    TP2: published no gain (#3188) and ~263 s with ~85 ms per HCCL all-reduce (#4118); model x{one / tp:.2f} "
        f"at {L.HCCL_LATENCY_US:.0f} us per collective, {tp85 / 1e3:.0f} s at 85 ms",
    ]


def _cards(text: str) -> list[int]:
    from vllm_omni_ascend_opt.warmup import parse_ints

    return parse_ints(text, "--cards")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write-table", action="store_true", help="trace everything and rewrite the table first")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument(
        "--cards", type=_cards, default=[], help="also the multi-card layouts for these card counts, e.g. 2,4,8"
    )
    p.add_argument("--markdown", action="store_true", help="print docs/device-model.md's tables instead")
    args = p.parse_args(argv)
    if args.markdown:
        print(markdown(args.steps))
        return 0
    t0 = time.perf_counter()
    traced = write_table() if args.write_table else None
    from vllm_omni_ascend_opt.devtime import report
    from vllm_omni_ascend_opt.devtime import table as TB

    table = TB.load(TB.TABLE_FILE)
    fit = report.calibration(table)
    print("\n".join(calibration_lines(fit)))
    for h, w in TB.RESOLUTIONS:
        for b in TB.BATCHES:
            wk = TB.workload_key(h, w, b)
            print()
            print("\n".join(report.text_tables(table, fit, wk, args.steps)))
    if args.cards:
        from vllm_omni_ascend_opt.devtime import layouts

        cards = args.cards
        for h, w in TB.RESOLUTIONS:
            print()
            print("\n".join(layouts.text_table(table, fit.params, h, w, args.steps, cards)))
        print()
        print("\n".join(published_checks(table, fit.params)))
    took = time.perf_counter() - t0
    print(f"\n  whole run {took:.1f} s" + (f" (trace {traced:.1f} s)" if traced is not None else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
