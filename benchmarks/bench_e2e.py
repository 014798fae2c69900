#!/usr/bin/env python
"""End-to-end benchmark: stock vs full stack vs each optimization alone, measured side by side in ONE run.

Usage (from the repo root, after `make venv`)::

    .venv/bin/python benchmarks/bench_e2e.py            # tiny model + real-width model
    .venv/bin/python benchmarks/bench_e2e.py --quick    # tiny model only
    .venv/bin/python benchmarks/bench_e2e.py --json out.json
    .venv/bin/python benchmarks/bench_e2e.py --models memory   # only the peak-memory table at 1328^2 / 1664x928

What it does: for each model (``tiny``: the embedded test-bed Qwen-Image; ``realwidth``: hidden 3072, 24 heads x 128,
RoPE axes 16/56/56, 2 blocks, random weights) one worker process loads the pipeline once through vLLM-Omni's own
loader, then, for each resolution, runs every configuration (``stock`` = ``none``, ``full`` = ``default``, and
``+name`` = that optimization alone) interleaved round-robin over the repeats, toggling in-process with
``vllm_omni_ascend_opt.api.select(spec, model=pipe)``. It prints, per configuration: median end-to-end latency, its
spread (min-max over repeats), the ratio to stock measured in the same run, kernel-launching aten ops per denoise
step (one transformer forward; views and allocation-only ops excluded), modulation-weight bytes read per step is
left to ``bench_transformer.py``, the process's peak memory (RSS high-water on CPU; allocator peak on CUDA/NPU), and
the peak memory of one transformer forward and of one VAE decode (tensor storage the call allocates and holds at
its worst moment, weights and inputs excluded: ``vllm_omni_ascend_opt/testbed/memory.py``), measured on a warm
request in an untimed generation. Optimizations that cannot be active here are listed with their reasons and not
timed; ``all`` is every optimization active here.

``memory`` (run by default, or alone with ``--models memory``): the peak of one warm transformer forward at real
width (hidden 3072, 24 heads x 128, RoPE 16/56/56, random weights) at the real model's token counts for 1328x1328
and 1664x928 (VAE /8 then 2x2 packing: 83x83 and 104x58 image tokens, plus 32 text tokens), for stock, default and
all, MiB and ratio to stock. It is measured with 1 and 2 blocks: a warm forward frees each block's activations
before the next block runs and keeps nothing per block, so its peak does not depend on the depth (the table shows
both; they are equal), and the 2-block figure is the 60-block one. The VAE decode at the real VAE config is
``bench_vae.py --sizes 1328x1328 1664x928`` (the test bed pipelines' VAE is a small one).

On CPU the ratios are FLOP-bound wall-clock numbers, reported next to the op counts; they are not the NPU claim.
On an NPU or GPU the same script runs on ``--device npu|cuda`` and synchronizes the device around each timed region.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MODELS = {
    # name: (resolutions, steps, repeats)
    "tiny": ([(64, 64), (128, 128)], 4, 7),
    "realwidth": ([(128, 128), (256, 256)], 2, 3),
    "memory": ([(1328, 1328), (1664, 928)], 1, 1),  # peak-memory table only (no timing): see the docstring
}
#: Configurations of the peak-memory table.
MEMORY_CONFIGS = {"stock": "none", "default": "default", "all": "all"}
MEMORY_DEPTHS = (1, 2)


class PeakMemory:
    """Peak memory over a region: allocator peak on CUDA/NPU, sampled RSS high-water on CPU."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.peak = 0
        self._stop = threading.Event()

    def __enter__(self) -> PeakMemory:
        import torch

        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        elif self.device == "npu":
            torch.npu.reset_peak_memory_stats()
        else:
            import psutil

            proc = psutil.Process()
            self.peak = proc.memory_info().rss

            def sample() -> None:
                while not self._stop.wait(0.005):
                    self.peak = max(self.peak, proc.memory_info().rss)

            self._t = threading.Thread(target=sample, daemon=True)
            self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        import torch

        if self.device == "cuda":
            self.peak = torch.cuda.max_memory_allocated()
        elif self.device == "npu":
            self.peak = torch.npu.max_memory_allocated()
        else:
            self._stop.set()
            self._t.join()


def memory_child(args: argparse.Namespace) -> None:
    """The peak-memory table: one warm transformer forward at real width, per depth, size and configuration."""
    import dataclasses

    import torch

    from vllm_omni_ascend_opt import api
    from vllm_omni_ascend_opt.testbed import REALWIDTH, blockops
    from vllm_omni_ascend_opt.testbed.memory import measure
    from vllm_omni_ascend_opt.testbed.runtime import init_cpu_runtime

    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_transformer import TEXT_TOKENS, make_inputs

    torch.set_num_threads(os.cpu_count() or 1)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.memory_dtype]
    t0 = time.perf_counter()
    rt = init_cpu_runtime(None, dtype=dtype)
    rows = []
    for depth in MEMORY_DEPTHS:
        tr = blockops.build_transformer(rt, dataclasses.replace(REALWIDTH, num_layers=depth), dtype).to(args.device)
        for h, w in MODELS["memory"][0]:
            kw = {k: v.to(args.device) if torch.is_tensor(v) else v for k, v in make_inputs(tr, h, w, dtype).items()}

            def forward(model: Any, inputs: dict[str, Any]) -> torch.Tensor:
                with rt.context(), torch.inference_mode():
                    return model(**inputs)[0]

            outs = {}
            for name, spec in MEMORY_CONFIGS.items():
                api.select(spec, model=tr)
                forward(tr, kw)  # cold: fills the memo and tables (a repeated request's forward is the warm one)
                outs[name], peak = measure(forward, tr, kw, device=args.device)
                rows.append(
                    {
                        "resolution": f"{h}x{w}",
                        "image_tokens": kw["hidden_states"].shape[1],
                        "text_tokens": TEXT_TOKENS,
                        "blocks": depth,
                        "config": name,
                        "peak_bytes": peak.peak,
                        "identical_to_stock": bool(torch.equal(outs[name], outs["stock"])),
                    }
                )
            api.select("none", model=tr)
        del tr
    print(
        "BENCH_JSON "
        + json.dumps(
            {"memory_rows": rows, "dtype": args.memory_dtype, "device": args.device, "wall_s": time.perf_counter() - t0}
        )
    )


def child(args: argparse.Namespace) -> None:
    import torch

    if args.child == "memory":
        memory_child(args)
        return

    from vllm_omni_ascend_opt import _backend, api, registry
    from vllm_omni_ascend_opt.testbed import REALWIDTH, TINY, build_model_dir
    from vllm_omni_ascend_opt.testbed.memory import first_call_peaks, pipeline_targets
    from vllm_omni_ascend_opt.testbed.opcount import count_module_calls
    from vllm_omni_ascend_opt.testbed.pipeline import generate, load_pipeline
    from vllm_omni_ascend_opt.testbed.runtime import init_cpu_runtime

    torch.set_num_threads(os.cpu_count() or 1)
    spec = {"tiny": TINY, "realwidth": REALWIDTH}[args.child]
    resolutions, steps, repeats = MODELS[args.child]
    if args.quick:
        resolutions, steps, repeats = resolutions[:1], 2, 3
    repeats = args.repeats or repeats
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    t0 = time.perf_counter()
    model_dir = build_model_dir(spec)
    rt = init_cpu_runtime(str(model_dir), dtype=dtype)
    api.select("none")
    pipe = load_pipeline(rt, device=args.device)
    load_s = time.perf_counter() - t0

    configs: dict[str, str] = {"stock": "none", "full": "default"}
    skipped: dict[str, list[str]] = {}
    for opt in registry.all_optimizations():
        why = opt.reasons_inactive()
        if why:
            skipped[opt.name] = why
        else:
            configs[f"+{opt.name}"] = f"none,+{opt.name}"
    if any(not o.default_enabled and not o.reasons_inactive() for o in registry.all_optimizations()):
        configs["all"] = "all"  # every optimization active here (the default-off ones too)

    def run(spec_: str, h: int, w: int, seed: int):
        api.select(spec_, model=pipe)
        _backend.synchronize(args.device)
        t = time.perf_counter()
        res = generate(pipe, rt, "a red cat on a blue sofa", height=h, width=w, steps=steps, seed=seed)
        _backend.synchronize(args.device)
        return (time.perf_counter() - t) * 1e3, res

    rows = []
    for h, w in resolutions:
        per: dict[str, list[float]] = {c: [] for c in configs}
        ops: dict[str, int] = {}
        peak: dict[str, int] = {}
        calls_peak: dict[str, dict[str, int]] = {}
        images: dict[str, object] = {}
        for name, s in configs.items():  # warm-up + op count + peak memory, untimed
            run(s, h, w, 0)
            api.select(s, model=pipe)
            with count_module_calls(pipe.transformer) as calls, PeakMemory(args.device) as pm:
                images[name] = generate(
                    pipe, rt, "a red cat on a blue sofa", height=h, width=w, steps=steps, seed=1
                ).images
            ops[name] = calls[0].total if calls else 0
            peak[name] = pm.peak
            with first_call_peaks(pipeline_targets(pipe), device=args.device) as peaks:  # a warm request
                generate(pipe, rt, "a red cat on a blue sofa", height=h, width=w, steps=steps, seed=1)
            calls_peak[name] = {label: p.peak for label, p in peaks.items()}
        for r in range(repeats):  # interleaved: drift hits every configuration alike
            order = list(configs) if r % 2 == 0 else list(reversed(configs))
            for name in order:
                ms, _ = run(configs[name], h, w, 42 + r)
                per[name].append(ms)
        stock_med = statistics.median(per["stock"])
        for name in configs:
            med = statistics.median(per[name])
            rows.append(
                {
                    "model": args.child,
                    "resolution": f"{h}x{w}",
                    "config": name,
                    "spec": configs[name],
                    "median_ms": med,
                    "min_ms": min(per[name]),
                    "max_ms": max(per[name]),
                    "ratio_vs_stock": med / stock_med,
                    "ops_per_step": ops[name],
                    "peak_mem_mb": peak[name] / 2**20,
                    "forward_peak_bytes": calls_peak[name].get("transformer_forward"),
                    "vae_peak_bytes": calls_peak[name].get("vae_decode"),
                    "forward_peak_vs_stock": _over(calls_peak[name], calls_peak["stock"], "transformer_forward"),
                    "vae_peak_vs_stock": _over(calls_peak[name], calls_peak["stock"], "vae_decode"),
                    "identical_to_stock": bool(torch.equal(images[name], images["stock"])),
                    "raw_ms": per[name],
                }
            )
    api.select("none", model=pipe)
    print(
        "BENCH_JSON "
        + json.dumps(
            {
                "rows": rows,
                "skipped": skipped,
                "load_s": load_s,
                "steps": steps,
                "repeats": repeats,
                "dtype": args.dtype,
                "device": args.device,
            }
        )
    )


def _over(peaks: dict[str, int], stock: dict[str, int], label: str) -> float | None:
    return peaks[label] / stock[label] if peaks.get(label) is not None and stock.get(label) else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,realwidth,memory", help="comma list of: " + ", ".join(MODELS))
    ap.add_argument("--memory-dtype", default="bf16", choices=["fp32", "bf16"], help="dtype of the memory table")
    ap.add_argument("--quick", action="store_true", help="tiny model, one resolution, 2 steps, 3 repeats")
    ap.add_argument("--repeats", type=int, default=0, help="override repeats per configuration")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "npu"])
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    models = ["tiny"] if args.quick else [m.strip() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in MODELS:
            ap.error(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    results = []
    t0 = time.perf_counter()
    for m in models:
        cmd = [sys.executable, __file__, "--child", m, "--dtype", args.dtype, "--device", args.device]
        cmd += ["--memory-dtype", args.memory_dtype]
        cmd += ["--quick"] if args.quick else []
        cmd += ["--repeats", str(args.repeats)] if args.repeats else []
        print(f"[bench_e2e] {m}: running ...", flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH_JSON ")), None)
        if proc.returncode != 0 or line is None:
            print(proc.stdout[-3000:], proc.stderr[-6000:], sep="\n")
            print(f"[bench_e2e] {m}: worker failed (exit {proc.returncode})")
            return 1
        results.append(json.loads(line.removeprefix("BENCH_JSON ")))
    _print(results)
    print(f"\ntotal wall time {time.perf_counter() - t0:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


def _print(results: list[dict]) -> None:
    import platform

    from vllm_omni_ascend_opt.testbed.memory import mib

    print(
        f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}"
    )
    for res in results:
        if "memory_rows" in res:
            _print_memory(res)
            continue
        print(
            f"\n== {res['rows'][0]['model']} ({res['dtype']}, {res['device']}, {res['steps']} steps, "
            f"{res['repeats']} interleaved repeats, load {res['load_s']:.1f} s excluded)"
        )
        hdr = (
            f"{'resolution':<10} {'config':<20} {'median ms':>10} {'min-max ms':>17} {'vs stock':>9} "
            f"{'ops/step':>9} {'peak MB':>8} {'fwd MiB':>8} {'x stock':>7} {'vae MiB':>8} {'x stock':>7}  identical"
        )
        print(hdr)
        print("-" * len(hdr))
        for r in res["rows"]:
            print(
                f"{r['resolution']:<10} {r['config']:<20} {r['median_ms']:>10.1f} "
                f"{r['min_ms']:>8.1f}-{r['max_ms']:<8.1f} {r['ratio_vs_stock']:>8.3f}x {r['ops_per_step']:>9} "
                f"{r['peak_mem_mb']:>8.0f} {mib(r['forward_peak_bytes']):>8} {_x(r['forward_peak_vs_stock']):>7} "
                f"{mib(r['vae_peak_bytes']):>8} {_x(r['vae_peak_vs_stock']):>7}  "
                f"{'yes' if r['identical_to_stock'] else 'no'}"
            )
        for name, why in res["skipped"].items():
            print(f"  skipped {name}: {'; '.join(why)}")
        print(
            "  peak MB = process RSS high-water; fwd / vae MiB = tensor storage one transformer forward / one VAE "
            "decode allocates and holds at its worst moment (weights and inputs excluded), on a warm request"
        )


def _x(v: float | None) -> str:
    return "–" if v is None else f"{v:.3f}"


def _print_memory(res: dict) -> None:
    """The peak-memory table: one warm transformer forward at real width (see the module docstring)."""
    from vllm_omni_ascend_opt.testbed.memory import mib

    print(
        f"\n== peak memory of one warm transformer forward, real width (hidden 3072, 24x128), random weights, "
        f"{res['dtype']}, {res['device']}, B=1, CFG off ({res['wall_s']:.0f} s)"
    )
    hdr = f"{'size':<10} {'tokens':>12} {'blocks':>6} {'config':<8} {'peak MiB':>9} {'x stock':>8}  identical"
    print(hdr)
    print("-" * len(hdr))
    stock = {(r["resolution"], r["blocks"]): r["peak_bytes"] for r in res["memory_rows"] if r["config"] == "stock"}
    for r in res["memory_rows"]:
        base = stock[(r["resolution"], r["blocks"])]
        print(
            f"{r['resolution']:<10} {r['image_tokens']:>6}+{r['text_tokens']:<5} {r['blocks']:>6} {r['config']:<8} "
            f"{mib(r['peak_bytes']):>9} {r['peak_bytes'] / base:>8.3f}  {'yes' if r['identical_to_stock'] else 'no'}"
        )
    print(
        "  tensor storage the forward allocates and holds at its worst moment (weights and inputs excluded); "
        "equal at 1 and 2 blocks: the peak does not depend on the depth, so it is the 60-block figure"
    )


if __name__ == "__main__":
    raise SystemExit(main())
