#!/usr/bin/env python
"""VAE decode benchmark: stock vs vae_exact vs vae_fast (and both), measured side by side in ONE run.

Usage (from the repo root, after `make venv`)::

    .venv/bin/python benchmarks/bench_vae.py                 # real width, 256^2 and 512^2, bf16
    .venv/bin/python benchmarks/bench_vae.py --dtype fp32
    .venv/bin/python benchmarks/bench_vae.py --pieces        # also each piece alone (ablation of the pieces)
    .venv/bin/python benchmarks/bench_vae.py --sizes 256 --repeats 5 --json out.json
    .venv/bin/python benchmarks/bench_vae.py --sizes 1328x1328 1664x928 --repeats 1   # the peak-memory sizes

What it does: builds vLLM-Omni's ``DistributedAutoencoderKLQwenImage`` at the real Qwen-Image VAE width (base_dim 96,
z_dim 16, dim_mult [1, 2, 4, 4], 2 res blocks, temporal downsample [F, T, T]) with seeded random weights, and for
each image size decodes one single-frame latent (what text-to-image decodes) under every configuration, toggled in
process with ``vllm_omni_ascend_opt.api.select(spec, model=vae)`` and interleaved round-robin over the repeats so
that machine noise hits all configurations alike. It prints per configuration: the median decode time (and min),
the ratio to stock measured in the same run, kernel-launching aten ops per decode (views and allocation-only ops
excluded: vllm_omni_ascend_opt/testbed/opcount.py), the image quality against stock (pixel identity, SSIM,
PSNR on the 8-bit images: vllm_omni_ascend_opt/ablation/metrics.py), and the peak memory of one decode with its ratio to
stock: bytes of tensor storage the decode allocates and holds at its worst moment, weights and the latent excluded
(vllm_omni_ascend_opt/testbed/memory.py; one extra, untimed decode per configuration and size). On a VAE the
default stack is ``vae_exact`` and ``all`` is ``vae_exact+vae_fast`` (the transformer optimizations do not apply).

On CPU the ratios are wall-clock numbers of a FLOP-bound machine, reported next to the op counts; they are not the
NPU claim. ``--device npu|cuda`` runs the same measurement there (synchronizing around each timed decode).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CONFIGS = {
    "stock": "none",
    "vae_exact": "none,+vae_exact",
    "vae_fast": "none,+vae_fast",
    "vae_exact+vae_fast": "none,+vae_exact,+vae_fast",
}


def build_vae(dtype, device):
    import torch
    from vllm_omni.diffusion.distributed.autoencoders.autoencoder_kl_qwenimage import (
        DistributedAutoencoderKLQwenImage,
    )

    torch.manual_seed(0)
    vae = DistributedAutoencoderKLQwenImage(
        base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True]
    ).eval()
    with torch.no_grad():  # RMS-norm gammas start at 1; draw them so that the norms matter as in a trained model
        for m in vae.modules():
            if hasattr(m, "gamma"):
                m.gamma.uniform_(0.5, 1.5)
    return vae.to(device=device, dtype=dtype)


def piece_configs(names: list[str]) -> dict[str, tuple[str, str, str]]:
    """``label -> (spec, optimization, piece)``: each piece of each VAE optimization alone on stock."""
    from vllm_omni_ascend_opt import registry

    out = {}
    for name in names:
        for piece in registry.get(name).pieces:
            if piece == "latents_stats_cache":  # pipeline-level, not part of vae.decode
                continue
            out[f"{name}:{piece}"] = (f"none,+{name}", name, piece)
    return out


def parse_size(text: str) -> tuple[int, int]:
    """``"512"`` -> (512, 512); ``"1664x928"`` -> (1664, 928) (height x width, multiples of 8)."""
    h, _, w = text.lower().partition("x")
    size = (int(h), int(w or h))
    if any(v <= 0 or v % 8 for v in size):
        raise argparse.ArgumentTypeError(f"{text!r}: sizes are positive multiples of 8")
    return size


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--sizes", type=parse_size, nargs="+", default=[(256, 256), (512, 512)], help="N or HxW, multiples of 8"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], default="bf16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--pieces", action="store_true", help="also time each piece alone (ablation of the pieces)")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("BENCH_THREADS", "2")))
    ap.add_argument("--json", type=Path, help="write the results here as JSON")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from vllm_omni_ascend_opt import _backend, api, registry
    from vllm_omni_ascend_opt.ablation.metrics import compare_images
    from vllm_omni_ascend_opt.testbed.memory import measure, mib, ratio
    from vllm_omni_ascend_opt.testbed.opcount import count_ops

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[args.dtype]
    device = torch.device(args.device)
    t0 = time.perf_counter()
    vae = build_vae(dtype, device)
    print(
        f"# VAE decode, DistributedAutoencoderKLQwenImage at real width (base_dim 96, z_dim 16), {args.dtype}, "
        f"{device}, {args.threads} threads, median of {args.repeats} (interleaved); torch {torch.__version__}",
        flush=True,
    )

    configs = {label: (spec, None, None) for label, spec in CONFIGS.items()}
    if args.pieces:
        configs.update(piece_configs(["vae_exact", "vae_fast"]))

    def select(label: str) -> None:
        spec, opt_name, piece = configs[label]
        for name in ("vae_exact", "vae_fast"):
            opt = registry.get(name)
            opt.enabled_pieces = {piece} if name == opt_name and piece else set(opt.pieces)
        api.select("none", model=vae)  # detach, so the next select re-attaches with these pieces
        api.select(spec, model=vae)

    def decode(z):
        with torch.no_grad():
            out = vae.decode(z, return_dict=False)[0]
        _backend.synchronize(device)
        return out

    results: dict = {"dtype": args.dtype, "device": str(device), "threads": args.threads, "sizes": {}}
    smallest = min(args.sizes, key=lambda s: s[0] * s[1])
    for height, width in args.sizes:
        gen = torch.Generator().manual_seed(height * 100_000 + width)
        z = torch.randn(1, 16, 1, height // 8, width // 8, generator=gen).to(device=device, dtype=dtype)
        images, times, ops, peaks = {}, {label: [] for label in configs}, {}, {}
        for label in configs:  # warm-up, reference images, op counts and peak memory (all untimed)
            select(label)
            images[label] = decode(z)[:, :, 0].float().cpu()
            if (height, width) == smallest:
                ops[label] = count_ops(lambda: decode(z))[1].total  # noqa: B023
            peaks[label] = measure(decode, z, device=str(device))[1].peak
        for _ in range(args.repeats):
            for label in configs:
                select(label)
                t = time.perf_counter()
                decode(z)
                times[label].append(time.perf_counter() - t)
        api.select("none", model=vae)
        base = statistics.median(times["stock"])
        print(f"\n## {height}x{width} (latent {height // 8}x{width // 8})")
        print(
            f"{'config':36s} {'median ms':>10s} {'min ms':>9s} {'x stock':>8s} {'ops':>5s} {'peak MiB':>9s} "
            f"{'x stock':>8s}  quality vs stock"
        )
        rows = {}
        for label in configs:
            med = statistics.median(times[label])
            q = compare_images(images["stock"], images[label])
            quality = (
                "pixel-identical"
                if q["pixel_identical"] and q["max_abs_diff"] == 0
                else f"SSIM {q['ssim']:.5f}  PSNR {q['psnr']:.2f} dB  max|d| {q['max_abs_diff']:.1e}"
            )
            n_ops = ops.get(label)
            print(
                f"{label:36s} {med * 1e3:10.0f} {min(times[label]) * 1e3:9.0f} {base / med:8.2f} "
                f"{n_ops if n_ops is not None else '':>5} {mib(peaks[label]):>9s} "
                f"{ratio(peaks[label], peaks['stock']):>8s}  {quality}",
                flush=True,
            )
            rows[label] = {"median_ms": med * 1e3, "times_ms": [t * 1e3 for t in times[label]], "ratio": base / med}
            rows[label].update({"ops": n_ops, **{k: q[k] for k in ("pixel_identical", "ssim", "psnr", "max_abs_diff")}})
            rows[label].update({"peak_bytes": peaks[label], "peak_vs_stock": peaks[label] / peaks["stock"]})
        results["sizes"][f"{height}x{width}"] = rows
    print(
        f"\n# total {time.perf_counter() - t0:.0f} s; ops = kernel-launching aten ops per decode at "
        f"{smallest[0]}x{smallest[1]}; peak = tensor storage one decode allocates and holds at its worst moment "
        "(weights and latent excluded; testbed/memory.py)"
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
