#!/usr/bin/env python
"""RoPE benchmark: stock vs `rope` on the real-width transformer, measured side by side in ONE run.

Usage (from the repo root)::

    .venv/bin/python benchmarks/bench_rope.py                 # fp32, 128x128 and 256x256
    .venv/bin/python benchmarks/bench_rope.py --dtype bf16 --repeats 9 --json out.json

What it prints, per resolution (real-width Qwen-Image: hidden 3072, 24 heads x 128, RoPE axes 16/56/56, 2 blocks,
random weights, loaded through vLLM-Omni's own loader):

* transformer forward (one denoise step) median ms for ``stock`` (``none``) and ``rope`` (``none,+rope``), spread,
  and the ratio measured in the same run (configurations interleaved round-robin over the repeats);
* kernel-launching aten ops per step and per block (views and allocation-only ops excluded), stock vs rope (portable
  path) vs rope through the semantic torch_npu fake from ``tests/`` (op count only: the fake runs on CPU);
* freqs -> cos/sin conversions (``torch.real``/``torch.imag``) per step, cold and warm;
* the RoPE function alone (``_qwen_image_qk_norm_rope``, img stream) at Qwen-Image's 1280x704 shape
  (B=1, S=3520, N=24, D=128): stock vs rope median and ratio.

On CPU the ratios are FLOP/memory-bound wall-clock numbers reported next to the op counts, not the NPU claim (on an
NPU batch-1 eager Qwen-Image is bound by kernel launches, which the op counts stand for).
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


def _conversions(fn):
    import torch
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (torch.real, torch.imag) and args and args[0].is_complex():
                Count.n += 1
            return func(*args, **(kwargs or {}))

    Count.n = 0
    with Count():
        fn()
    return Count.n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--resolutions", default="128x128,256x256")
    ap.add_argument("--txt", type=int, default=32, help="text tokens")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import torch

    from vllm_omni_ascend_opt import _backend, api
    from vllm_omni_ascend_opt.blocks.upstream import targets as _targets
    from vllm_omni_ascend_opt.opts.rope import OPT
    from vllm_omni_ascend_opt.testbed import REALWIDTH, build_model_dir
    from vllm_omni_ascend_opt.testbed.opcount import OpCounter, count_module_calls
    from vllm_omni_ascend_opt.testbed.pipeline import load_pipeline
    from vllm_omni_ascend_opt.testbed.runtime import init_cpu_runtime

    torch.set_num_threads(os.cpu_count() or 1)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    t0 = time.perf_counter()
    rt = init_cpu_runtime(str(build_model_dir(REALWIDTH)), dtype=dtype)
    api.select("none")
    pipe = load_pipeline(rt)
    tr = pipe.transformer
    print(f"[bench_rope] real-width model loaded in {time.perf_counter() - t0:.0f} s ({args.dtype})", flush=True)
    in_ch, txt_dim = tr.in_channels, REALWIDTH.joint_attention_dim
    configs = {"stock": "none", "rope": "none,+rope"}

    def forward(h: int, w: int, seed: int = 0) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        lh, lw = h // 16, w // 16  # VAE /8, then 2x2 patches
        hs = torch.randn(1, lh * lw, in_ch, generator=g).to(dtype)
        ehs = torch.randn(1, args.txt, txt_dim, generator=g).to(dtype)
        with rt.context(), torch.no_grad():
            return tr(
                hidden_states=hs,
                encoder_hidden_states=ehs,
                encoder_hidden_states_mask=torch.ones(1, args.txt, dtype=torch.long),
                timestep=torch.tensor([0.5]),
                img_shapes=[[(1, lh, lw)]],
                txt_seq_lens=[args.txt],
            ).sample

    def counts(h: int, w: int) -> tuple[int, int]:
        forward(h, w)  # warm (tables, verification)
        with count_module_calls(tr.transformer_blocks[-1]) as blk, OpCounter() as step:
            forward(h, w)
        return step.total, blk[0].total

    rows = []
    for res in args.resolutions.split(","):
        h, w = (int(v) for v in res.split("x"))
        out: dict[str, torch.Tensor] = {}
        ops: dict[str, tuple[int, int]] = {}
        conv: dict[str, tuple[int, int]] = {}
        for name, spec in configs.items():
            api.select(spec, model=pipe)
            cold = _conversions(lambda h=h, w=w: forward(h, w))
            warm = _conversions(lambda h=h, w=w: forward(h, w))
            conv[name] = (cold, warm)
            ops[name] = counts(h, w)
            out[name] = forward(h, w, seed=7)
        # rope through the semantic torch_npu fake (tests/): op counts only
        fake_note = ""
        try:
            from tests.fake_torch_npu import build as build_fake
        except ImportError:
            build_fake = None
        if build_fake is not None:
            fake = build_fake()
            saved = (sys.modules.get("torch_npu"), getattr(torch, "npu", None))
            sys.modules["torch_npu"], torch.npu = fake, fake._torch_npu_namespace
            _backend.reset_cache()
            try:
                api.select("none")
                api.select("none,+rope", model=pipe)
                ops["rope (fake NPU)"] = counts(h, w)
                fake_note = "; ".join(v.describe() for v in OPT.verdicts())
            finally:
                if saved[0] is None:
                    sys.modules.pop("torch_npu", None)
                else:
                    sys.modules["torch_npu"] = saved[0]
                if saved[1] is None:
                    delattr(torch, "npu")
                else:
                    torch.npu = saved[1]
                _backend.reset_cache()
                api.select("none", model=pipe)
        times: dict[str, list[float]] = {n: [] for n in configs}
        for r in range(args.repeats):
            for name in list(configs) if r % 2 == 0 else list(reversed(configs)):
                api.select(configs[name], model=pipe)
                forward(h, w)  # keep caches/allocator warm for this configuration
                t = time.perf_counter()
                forward(h, w, seed=r)
                times[name].append((time.perf_counter() - t) * 1e3)
        stock_ms = statistics.median(times["stock"])
        for name in ops:
            med = statistics.median(times[name]) if name in times else None
            rows.append(
                {
                    "resolution": res,
                    "tokens": (h // 16) * (w // 16),
                    "config": name,
                    "median_ms": med,
                    "min_ms": min(times[name]) if name in times else None,
                    "max_ms": max(times[name]) if name in times else None,
                    "ratio_vs_stock": med / stock_ms if med else None,
                    "ratio_of_mins": min(times[name]) / min(times["stock"]) if name in times else None,
                    "ops_per_step": ops[name][0],
                    "ops_per_block": ops[name][1],
                    "cos_sin_conversions_cold_warm": conv.get(name),
                    "bitwise_equal_to_stock": bool(torch.equal(out[name], out["stock"])) if name in out else None,
                }
            )
        if fake_note:
            rows[-1]["note"] = fake_note

    # the RoPE function alone at the 1280x704 img-stream shape
    mod = sys.modules[_targets.TRANSFORMER]
    attn = tr.transformer_blocks[0].attn
    g = torch.Generator().manual_seed(0)
    s = (1280 // 16) * (704 // 16)
    q = torch.randn(1, s, 24, 128, generator=g).to(dtype)
    k = torch.randn(1, s, 24, 128, generator=g).to(dtype)
    freqs = tr.pos_embed([[(1, 1280 // 16, 704 // 16)]], [args.txt], torch.device("cpu"))[0]
    micro: dict[str, list[float]] = {n: [] for n in configs}
    for r in range(args.repeats * 2):
        for name in list(configs) if r % 2 == 0 else list(reversed(configs)):
            api.select(configs[name], model=pipe)
            fn = mod._qwen_image_qk_norm_rope
            with torch.no_grad():
                fn(q, k, attn.norm_q, attn.norm_k, freqs, attn.rope, attn.eps)
                t = time.perf_counter()
                fn(q, k, attn.norm_q, attn.norm_k, freqs, attn.rope, attn.eps)
                micro[name].append((time.perf_counter() - t) * 1e3)
    api.select("none", model=pipe)
    micro_rows = {n: statistics.median(v) for n, v in micro.items()}

    print(
        f"\nRoPE benchmark ({args.dtype}, real-width 2-block transformer, {args.repeats} interleaved repeats, "
        f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs)"
    )
    hdr = (
        f"{'res':<8} {'tokens':>6} {'config':<16} {'median ms':>10} {'min-max ms':>17} {'ratio':>6} {'min-ratio':>9} "
        f"{'ops/step':>8} {'ops/block':>9} {'cos/sin conv cold/warm':>22} {'bitwise':>7}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        spread = f"{r['min_ms']:.1f}-{r['max_ms']:.1f}" if r["min_ms"] is not None else "-"
        med = f"{r['median_ms']:.1f}" if r["median_ms"] is not None else "-"
        ratio = f"{r['ratio_vs_stock']:.3f}" if r["ratio_vs_stock"] is not None else "-"
        mratio = f"{r['ratio_of_mins']:.3f}" if r["ratio_of_mins"] is not None else "-"
        conv_s = "/".join(map(str, r["cos_sin_conversions_cold_warm"])) if r["cos_sin_conversions_cold_warm"] else "-"
        bit = {True: "yes", False: "NO", None: "-"}[r["bitwise_equal_to_stock"]]
        print(
            f"{r['resolution']:<8} {r['tokens']:>6} {r['config']:<16} {med:>10} {spread:>17} {ratio:>6} {mratio:>9} "
            f"{r['ops_per_step']:>8} {r['ops_per_block']:>9} {conv_s:>22} {bit:>7}"
        )
        if r.get("note"):
            print(f"         note: {r['note']}")
    print(
        f"\n_qwen_image_qk_norm_rope alone, img stream at 1280x704 (1x{s}x24x128, {args.dtype}): "
        f"stock {micro_rows['stock']:.2f} ms, rope {micro_rows['rope']:.2f} ms, "
        f"ratio {micro_rows['rope'] / micro_rows['stock']:.3f}"
    )
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "qk_norm_rope_ms": micro_rows, "dtype": args.dtype}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
