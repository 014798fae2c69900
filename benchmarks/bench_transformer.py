#!/usr/bin/env python
"""Transformer-level benchmark of the pixel-exact transformer optimizations, side by side in ONE run.

Usage (from the repo root, after `make venv`)::

    .venv/bin/python benchmarks/bench_transformer.py                 # bf16, 128x128 and 256x256
    .venv/bin/python benchmarks/bench_transformer.py --quick         # 128x128 only, 2 repeats
    .venv/bin/python benchmarks/bench_transformer.py --dtype fp32 --repeats 5 --json out.json
    .venv/bin/python benchmarks/bench_transformer.py --pipeline edit-2511 --quick   # another pipeline's transformer

What it does: builds vLLM-Omni 0.30's real ``QwenImageTransformer2DModel`` at real width (the test bed's REALWIDTH
spec: hidden 3072, 24 heads x 128, RoPE axes 16/56/56, 2 blocks, random weights) on CPU, then for each resolution and
each configuration in :data:`CONFIGS` (a ``VLLM_OMNI_ASCEND_OPT`` spec, toggled in-process with
``api.select(spec, model=transformer)``) measures, for one transformer forward (= one denoise step without CFG, B=1):

* wall-clock: median and min of the warm forwards (memo filled, as on a repeated request), each with its ratio to
  ``stock`` in this run, and the cold forward (first forward after switching, memo empty). Configurations are
  interleaved round-robin (``--repeats`` rounds of one cold + ``--warm`` warm forwards each);
* kernel-launching aten ops (views and allocation-only ops excluded: ``testbed/opcount.py``) per block (block 0)
  and per step (the whole forward);
* modulation weight bytes read per step (``img_mod``/``txt_mod`` of every block and ``norm_out.linear``), counted by
  storage on the dispatched ops, next to what fraction of all DiT weights they are.

``--pipeline`` picks which Qwen-Image pipeline's transformer and inputs (issue 14): ``t2i`` (text-to-image; the
DMD2 few-step pipeline runs the same transformer and inputs), ``edit`` (Edit / Edit-Plus 2509: the output and one
condition image of the same size concatenated in the sequence, two RoPE tables), ``edit-2511`` (Edit-Plus with
``zero_cond_t``: the condition tokens modulated at timestep 0 through ``modulate_index``) and ``layered`` (3-D layer
RoPE over 2 layers + the combined image + the condition image, additional timestep conditioning).

Configurations whose optimizations cannot be active here are listed with their reasons and skipped.
On CPU the wall-clock ratios are FLOP-bound numbers (a 2-core CPU hides kernel-launch cost); the op counts are the
device-independent proxy for a launch-bound NPU. Neither is the NPU claim.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

#: name -> VLLM_OMNI_ASCEND_OPT spec. ``stock`` must stay first (ratios are relative to it).
CONFIGS: dict[str, str] = {
    "stock": "none",
    "shared_modulation": "none,+shared_modulation",
    "rope": "none,+rope",
    "both": "none,+shared_modulation,+rope",
    "joint_attention": "none,+joint_attention",
    "exact": "none,+shared_modulation,+rope,+joint_attention",
}
RESOLUTIONS: list[tuple[int, int]] = [(128, 128), (256, 256)]
#: --pipeline name -> (ModelSpec.variant arguments, description). DMD2 = t2i (same transformer and inputs).
PIPELINES: dict[str, tuple[dict[str, Any], str]] = {
    "t2i": ({"pipeline": "QwenImagePipeline"}, "text-to-image (and DMD2)"),
    "edit": ({"pipeline": "QwenImageEditPlusPipeline"}, "Edit / Edit-Plus 2509, 1 condition image"),
    "edit-2511": ({"pipeline": "QwenImageEditPlusPipeline", "zero_cond_t": True}, "Edit-Plus 2511 (zero_cond_t)"),
    "layered": ({"pipeline": "QwenImageLayeredPipeline"}, "Layered, 2 layers"),
}
LAYERS = 2
TEXT_TOKENS = 32
TIMESTEP = 0.7


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--repeats", type=int, default=3, help="round-robin rounds")
    p.add_argument("--warm", type=int, default=3, help="warm forwards per config per round")
    p.add_argument("--quick", action="store_true", help="128x128 only, 2 repeats")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma list of names from CONFIGS")
    p.add_argument("--pipeline", choices=tuple(PIPELINES), default="t2i", help="whose transformer and inputs")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------------------------
# model and inputs
# ----------------------------------------------------------------------------------------------------------------
def build_transformer(rt: Any, dtype: Any, pipeline: str = "t2i") -> Any:
    """vLLM-Omni's QwenImageTransformer2DModel at real width with the test bed's seeded random weights, configured
    as ``pipeline``'s (``zero_cond_t``, layer-3D RoPE and additional timestep conditioning where it has them)."""
    from vllm_omni_ascend_opt.testbed import REALWIDTH, blockops

    return blockops.build_transformer(rt, REALWIDTH.variant(**PIPELINES[pipeline][0]), dtype)


def make_inputs(tr: Any, height: int, width: int, dtype: Any, pipeline: str = "t2i") -> dict[str, Any]:
    """One denoise step's transformer inputs as ``pipeline`` builds them (``img_shapes`` per its forward)."""
    import torch

    g = torch.Generator().manual_seed(0)
    h, w = height // 16, width // 16  # VAE /8, then 2x2 packing
    shapes = {
        "t2i": [(1, h, w)],
        "edit": [(1, h, w), (1, h, w)],  # output, then the condition image (same size: the default request)
        "edit-2511": [(1, h, w), (1, h, w)],
        "layered": [(1, h, w)] * (LAYERS + 1) + [(1, h, w)],  # layers + combined image, then the condition image
    }[pipeline]
    tokens = sum(f * a * b for f, a, b in shapes)
    kw = dict(
        hidden_states=torch.randn(1, tokens, tr.in_channels, generator=g).to(dtype),
        encoder_hidden_states=torch.randn(1, TEXT_TOKENS, tr.txt_norm.normalized_shape[0], generator=g).to(dtype),
        encoder_hidden_states_mask=torch.ones(1, TEXT_TOKENS, dtype=torch.bool),
        timestep=torch.full((1,), TIMESTEP).to(dtype),
        img_shapes=[shapes],
        txt_seq_lens=[TEXT_TOKENS],
        return_dict=False,
    )
    if pipeline == "layered":
        kw["additional_t_cond"] = torch.zeros(1, dtype=torch.long)  # is_rgb = 0, as the pipeline passes
    return kw


# ----------------------------------------------------------------------------------------------------------------
# measurements
# ----------------------------------------------------------------------------------------------------------------
def forward_ms(tr: Any, rt: Any, kw: dict[str, Any]) -> tuple[float, float]:
    """(wall-clock ms, process CPU ms) of one forward. CPU time is far less disturbed by other processes on a
    shared machine than wall-clock (it does not count time spent descheduled)."""
    import torch

    with rt.context(), torch.inference_mode():
        t0, c0 = time.perf_counter(), time.process_time()
        tr(**kw)
        return (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3


def counts(tr: Any, rt: Any, kw: dict[str, Any], mod_tensors: list[Any]) -> dict[str, int]:
    """Ops per block 0, ops per step and modulation bytes read, on a warm forward (call after one forward).

    Counted under ``torch.no_grad`` (the project's convention: the tiny stock block counts 106), where composite ops
    such as ``linear`` show as the kernels they launch (``addmm``); under ``inference_mode`` the dispatcher hands the
    mode the composite op itself and the counts are lower for every configuration alike."""
    import torch

    from vllm_omni_ascend_opt.testbed.opcount import OpCounter, TensorReadCounter, count_module_calls

    with (
        rt.context(),
        torch.no_grad(),
        OpCounter() as ops,
        TensorReadCounter(mod_tensors) as reads,
        count_module_calls(tr.transformer_blocks[0]) as blocks,
    ):
        tr(**kw)
    return {"ops_per_block": blocks[0].total, "ops_per_step": ops.total, "mod_bytes_per_step": reads.bytes}


def modulation_prep_ms(tr: Any, rt: Any, dtype: Any, repeats: int = 5) -> dict[str, float]:
    """Isolated cost of one forward's modulation prep (min over repeats; less noisy than whole forwards):
    stock = what the blocks and norm_out compute from temb (SiLU + projection per img_mod/txt_mod, chunk/_modulate,
    ``1 + scale`` per norm; norm_out's SiLU + linear + ``1 + scale``); memo = shared_modulation's warm lookups
    (temb digest, weight signatures, slot hits) for the same forward."""
    import torch

    from vllm_omni_ascend_opt import api
    from vllm_omni_ascend_opt.opts.shared_modulation import OPT

    temb = torch.randn(1, tr.inner_dim).to(dtype)
    x = torch.zeros(1, 1, tr.inner_dim, dtype=dtype)

    def stock() -> None:
        for b in tr.transformer_blocks:
            img, txt = b.img_mod(temb), b.txt_mod(temb)
            for p in (*img.chunk(2, dim=-1), *txt.chunk(2, dim=-1)):
                scale, _, _ = b._modulate(p)
                _ = 1 + scale
        emb = tr.norm_out.linear(tr.norm_out.silu(temb).to(dtype))
        _ = 1 + emb.chunk(2, dim=1)[0]

    def memo() -> None:
        t = temb.clone()  # a new temb object per forward, as in the model: one digest
        for b in tr.transformer_blocks:
            OPT.memo.block(b, t)
        OPT.memo.norm_out(tr.norm_out, x, t)

    out = {}
    with rt.context(), torch.inference_mode():
        api.select("none", model=tr)
        for name, fn in (("stock", stock), ("memo", memo)):
            if name == "memo":
                api.select("none,+shared_modulation", model=tr)
            fn()  # warm-up (fills the memo)
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t0)
            out[name] = best * 1e3
    api.select("none", model=tr)
    return out


def unavailable(spec: str) -> list[str]:
    from vllm_omni_ascend_opt import flags, registry

    return [f"{n}: {r}" for n in flags.parse_spec(spec) for r in registry.get(n).reasons_inactive()]


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from vllm_omni_ascend_opt import api
    from vllm_omni_ascend_opt.blocks.memo.keys import modulation_linears
    from vllm_omni_ascend_opt.testbed.runtime import init_cpu_runtime

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    resolutions = RESOLUTIONS[:1] if args.quick else RESOLUTIONS
    repeats = 2 if args.quick else args.repeats

    rt = init_cpu_runtime(None, dtype=dtype)
    t0 = time.perf_counter()
    tr = build_transformer(rt, dtype, args.pipeline)
    build_s = time.perf_counter() - t0

    configs, skipped = {}, {}
    for name in args.configs.split(","):
        spec = CONFIGS[name]
        why = unavailable(spec)
        if why:
            skipped[name] = why
        else:
            configs[name] = spec
    mods = [p for lin in modulation_linears(tr) for p in lin.parameters()]
    mod_bytes = sum(p.numel() * p.element_size() for p in mods)
    all_bytes = sum(p.numel() * p.element_size() for p in tr.parameters())

    results: dict[str, Any] = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "dtype": args.dtype,
        "model": "REALWIDTH: hidden 3072, 24 heads x 128, 2 blocks, random weights",
        "pipeline": args.pipeline,
        "pipeline_desc": PIPELINES[args.pipeline][1],
        "build_s": round(build_s, 1),
        "modulation_weight_bytes": mod_bytes,
        "dit_weight_bytes": all_bytes,
        "skipped": skipped,
        "resolutions": {},
    }
    for height, width in resolutions:
        kw = make_inputs(tr, height, width, dtype, args.pipeline)
        rows: dict[str, dict[str, Any]] = {name: {"warm_ms": [], "warm_cpu_ms": [], "cold_ms": []} for name in configs}
        for name, spec in configs.items():  # counts first (one cold forward, then a counted warm one)
            api.select(spec, model=tr)
            forward_ms(tr, rt, kw)
            rows[name].update(counts(tr, rt, kw, mods))
        for _ in range(repeats):  # interleaved: every config once per round
            for name, spec in configs.items():
                api.select(spec, model=tr)  # switching drops the memo: the first forward is cold
                rows[name]["cold_ms"].append(forward_ms(tr, rt, kw)[0])
                for _ in range(args.warm):
                    wall, cpu = forward_ms(tr, rt, kw)
                    rows[name]["warm_ms"].append(wall)
                    rows[name]["warm_cpu_ms"].append(cpu)
        for row in rows.values():
            row["warm_median_ms"] = statistics.median(row["warm_ms"])
            row["warm_min_ms"] = min(row["warm_ms"])
            row["warm_cpu_median_ms"] = statistics.median(row["warm_cpu_ms"])
            row["cold_median_ms"] = statistics.median(row["cold_ms"])
        stock = rows.get("stock")
        for row in rows.values():
            row["ratio_vs_stock"] = row["warm_median_ms"] / stock["warm_median_ms"] if stock else None
            row["min_ratio_vs_stock"] = row["warm_min_ms"] / stock["warm_min_ms"] if stock else None
            row["cpu_ratio_vs_stock"] = row["warm_cpu_median_ms"] / stock["warm_cpu_median_ms"] if stock else None
        results["resolutions"][f"{height}x{width}"] = {
            "image_tokens": kw["hidden_states"].shape[1],
            "text_tokens": TEXT_TOKENS,
            "configs": rows,
        }
    if "shared_modulation" in configs and args.pipeline == "t2i":  # the isolated prep replays single-segment blocks
        results["modulation_prep_ms"] = modulation_prep_ms(tr, rt, dtype)
    api.select("none", model=tr)
    return results


def report(res: dict[str, Any]) -> str:
    m = res["machine"]
    lines = [
        f"bench_transformer: {res['model']}, {res['dtype']}, B=1, CFG off (one forward = one denoise step)",
        f"pipeline: {res.get('pipeline', 't2i')} ({res.get('pipeline_desc', 'text-to-image')})",
        f"machine: {m['cpu']}, {m['threads']} threads, torch {m['torch']}, python {m['python']}; "
        f"build {res['build_s']} s",
        f"modulation weights: {res['modulation_weight_bytes'] / 1e6:.1f} MB = "
        f"{res['modulation_weight_bytes'] / res['dit_weight_bytes']:.3f} of all DiT weights "
        f"({res['dit_weight_bytes'] / 1e6:.1f} MB)",
    ]
    if "modulation_prep_ms" in res:
        prep = res["modulation_prep_ms"]
        lines.append(
            f"modulation prep per forward, isolated (min of 5): stock {prep['stock']:.2f} ms, "
            f"shared_modulation warm lookups {prep['memo']:.2f} ms"
        )
    for name, why in res["skipped"].items():
        lines.append(f"skipped {name}: {'; '.join(why)}")
    for reso, r in res["resolutions"].items():
        lines.append("")
        lines.append(f"{reso}  ({r['image_tokens']} image + {r['text_tokens']} text tokens)")
        lines.append(
            f"  {'config':<18} {'warm ms':>9} {'ratio':>6} {'min ms':>9} {'ratio':>6} {'cpu ms':>9} {'ratio':>6} "
            f"{'cold ms':>9} "
            f"{'ops/block':>9} {'ops/step':>8} "
            f"{'mod MB/step':>11}"
        )
        for name, row in r["configs"].items():
            ratio = f"{row['ratio_vs_stock']:.3f}" if row["ratio_vs_stock"] is not None else "-"
            min_ratio = f"{row['min_ratio_vs_stock']:.3f}" if row["min_ratio_vs_stock"] is not None else "-"
            cpu_ratio = f"{row['cpu_ratio_vs_stock']:.3f}" if row["cpu_ratio_vs_stock"] is not None else "-"
            lines.append(
                f"  {name:<18} {row['warm_median_ms']:>9.1f} {ratio:>6} {row['warm_min_ms']:>9.1f} {min_ratio:>6} "
                f"{row['warm_cpu_median_ms']:>9.1f} {cpu_ratio:>6} "
                f"{row['cold_median_ms']:>9.1f} "
                f"{row['ops_per_block']:>9} {row['ops_per_step']:>8} {row['mod_bytes_per_step'] / 1e6:>11.1f}"
            )
    lines.append("")
    lines.append("warm = median / min over rounds x warm forwards with the memo filled (a repeated request), timed")
    lines.append("under inference_mode like vLLM-Omni's runner, each ratio against stock's same statistic; the min is")
    lines.append("the robust one on a shared machine; cpu = median process CPU time (2 threads summed), the least")
    lines.append("disturbed by other processes. cold = median first forward after switching. Ops counted under")
    lines.append("no_grad (views/allocation excluded). CPU wall-clock ratios are not the NPU claim.")
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
