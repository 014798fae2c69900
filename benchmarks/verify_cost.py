#!/usr/bin/env python
"""One-time cost of the per-shape-class kernel checks at the production shapes, measured through the test fake on CPU.

Usage (repo root, CPU; no NPU needed)::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/verify_cost.py            # S = 4352, B*N = 24 and 48, D = 128, bf16
    PYTHONPATH=$PWD .venv/bin/python benchmarks/verify_cost.py --seq 512  # quicker
    PYTHONPATH=$PWD .venv/bin/python benchmarks/verify_cost.py --cold-start  # 1328x1328, 1664x928, B=1,2

``--cold-start`` runs ``vllm-omni-ascend-opt warmup``'s checks (every class those sizes hit, the plugin's own code)
twice: a first start with an empty verdict cache, then a second start (a new backend probe, nothing in memory) that
finds every verdict on disk; it prints the cost per shape class and that the second start runs no check.

For ``rope`` (``RotaryPath.class_check``: chunked fp32 reference and stock's own error on the real call's output)
and ``fused_attention`` (``AttentionPath.class_check``: the kernel on random inputs of the call's shapes, a chunked
fp32 reference and stock SDPA on the same chunks) it prints the check's wall time next to one call of the (fake) kernel,
median of ``--repeats``. These are **the fake's costs on this CPU**: the fake computes each kernel with plain torch,
and the reference runs on the CPU. On an NPU the same check runs on the device; ``benchmarks/npu_check_kernels.py``
prints the real one-time cost there. The check runs once per shape class per process (a diffusion request at one
resolution has two classes per kernel: B*N for the conditional and unconditional batch if CFG is batched).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[1]


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cold_start(sizes: str, batches: str, texts: str, sp: int) -> int:
    """First start (empty verdict cache: every class checked) vs second start (saved verdicts: no check), through
    ``vllm_omni_ascend_opt.warmup`` - the plugin's own check code - on the fake at real width."""
    import tempfile

    import pytest
    import vllm_omni.diffusion.attention.backends.sdpa  # noqa: F401  (before the fake: accelerate probes torch_npu)

    sys.path.insert(0, str(REPO))
    from tests.fake_torch_npu import install
    from vllm_omni_ascend_opt import _backend, registry, warmup
    from vllm_omni_ascend_opt.blocks.kernels import saved

    opts = [registry.get(n) for n in ("rope", "qk_norm", "fused_attention")]
    mp = pytest.MonkeyPatch()
    mp.setenv(saved.ENV_VERDICT_CACHE, tempfile.mkdtemp(prefix="verdicts-"))
    mp.setattr(_backend, "npu_device", lambda: torch.device("cpu"))
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    args = (warmup.parse_sizes(sizes), warmup.parse_ints(batches, "--batch"), sp, warmup.parse_ints(texts, "--text"))
    print(f"verify_cost --cold-start: the torch_npu FAKE on CPU ({torch.get_num_threads()} threads), bf16, 24 heads, "
          f"D=128; sizes {sizes}, batch {batches}, text {texts}, sp {sp}")  # fmt: skip
    try:
        totals = []
        for start in ("first start (empty cache)", "second start (saved verdicts)"):
            install(mp)  # a new process: a new backend probe, no verdict in memory
            saved.forget()
            for o in opts:
                o.stats.clear()
            t0 = time.perf_counter()
            rows = warmup.warm(*args)
            wall = time.perf_counter() - t0
            checks = sum(o.stats["shape_checks"] for o in opts)
            totals.append((start, wall, checks, len(rows)))
            print(f"\n{start}:")
            print(f"  {'kernel':<22} {'shape class':<42} {'outcome':<10} {'check s':>8}")
            for r in rows:
                print(f"  {r.kernel:<22} {r.shape:<42} {r.outcome:<10} {r.seconds:8.3f}")
        print()
        for start, wall, checks, n in totals:
            print(f"{start:<32} {n} classes, {checks:>3} checks run, {wall:8.2f} s")
        print(f"second / first start: {totals[1][1] / totals[0][1]:.4f}x")
    finally:
        mp.undo()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=4352, help="joint sequence length (default 4352 = 256 text + 4096 image)")
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--cold-start", action="store_true", help="first start vs second start with saved verdicts")
    p.add_argument("--sizes", default="1328x1328,1664x928", help="--cold-start: image sizes")
    p.add_argument("--batch", default="1,2", help="--cold-start: batch sizes")
    p.add_argument("--text", default="256", help="--cold-start: prompt token counts")
    p.add_argument("--sp", type=int, default=1, help="--cold-start: Ulysses degree")
    a = p.parse_args(argv)
    if a.cold_start:
        return cold_start(a.sizes, a.batch, a.text, a.sp)

    import pytest
    import vllm_omni.diffusion.attention.backends.sdpa  # noqa: F401  (before the fake: accelerate probes torch_npu)

    sys.path.insert(0, str(REPO))
    from tests.fake_torch_npu import install
    from vllm_omni_ascend_opt.blocks.kernels import npu_attention as fa
    from vllm_omni_ascend_opt.blocks.kernels import rope_tables, rotary

    mp = pytest.MonkeyPatch()
    npu = install(mp)
    rpath = rotary.RotaryPath(SimpleNamespace(use_npu_kernel=True, requires_bitwise=lambda: False), Counter(), "cost")
    apath = fa.AttentionPath("cost", Counter())
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    s, n, d, dtype = a.seq, a.heads, a.head_dim, torch.bfloat16
    print(f"verify_cost: the torch_npu FAKE on CPU ({torch.get_num_threads()} threads), bf16, S={s}, D={d}")
    print(f"{'check':<44} {'B*N':>4} {'check s':>9} {'1 call s':>9} {'ratio':>7}  verdict")
    g = torch.Generator().manual_seed(0)
    try:
        with torch.no_grad():
            for b in (1, 2):
                x = (torch.randn(b, s, n, d, generator=g) * 3).to(dtype)
                theta = torch.rand(s, d // 2, generator=g, dtype=torch.float64) * 6.283
                freqs = torch.polar(torch.ones_like(theta), theta).to(torch.complex64)
                t = rope_tables.Tables(dtype)
                cos, sin_signed = rope_tables.portable_tables(t, freqs, Counter())
                ncos, nsin = rope_tables.npu_tables(t, freqs, Counter())
                out = npu.npu_rotary_mul(x, ncos, nsin, rotary_mode="interleave")
                kernel = functools.partial(npu.npu_rotary_mul, x, ncos, nsin, rotary_mode="interleave")
                call = _median_s(kernel, a.repeats)
                check = functools.partial(rpath.class_check, x, out, cos, sin_signed)
                sv = check()
                chk = _median_s(check, a.repeats)
                print(f"{'RotaryPath.class_check':<44} {b * n:>4} {chk:>9.3f} {call:>9.3f} {chk / call:>6.1f}x  "
                      f"{'ok' if sv.ok else 'REFUSED: ' + sv.reason}")  # fmt: skip
                del x, out
            for b in (1, 2):
                q, k, v = (torch.randn(b, s, n, d, generator=g).to(dtype) for _ in range(3))
                masked = None
                if b == 2:
                    keep = torch.ones(b, s, dtype=torch.bool)
                    keep[1, 224:256] = False  # the second prompt 32 text tokens shorter
                    masked = fa.kernel_mask(keep, b, s, s)[0]
                scale = d**-0.5
                call = _median_s(functools.partial(fa.call_kernel, npu, q, k, v, masked, scale), a.repeats)
                t0 = time.perf_counter()
                sv = apath.class_check(npu, q, k, v, masked, scale)
                chk = time.perf_counter() - t0
                print(f"{'AttentionPath.class_check (+1 call)':<44} {b * n:>4} {chk:>9.3f} {call:>9.3f} "
                      f"{chk / call:>6.1f}x  {'ok' if sv.ok else 'REFUSED: ' + sv.reason}")  # fmt: skip
                del q, k, v
    finally:
        mp.undo()
    return 0


if __name__ == "__main__":
    sys.exit(main())
