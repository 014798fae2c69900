#!/usr/bin/env python
"""Check the plugin's Ascend kernels on this machine and time them against the stock path: one command, one table.

Usage (on an Ascend host with torch_npu, vLLM 0.30 and vLLM-Omni 0.30 installed, from the repo root)::

    python benchmarks/npu_check_kernels.py                 # bf16, Qwen-Image layout: B=1, 4096 image + 256 text
    python benchmarks/npu_check_kernels.py --dtype fp16 --img-tokens 6400 --iters 50 --json out.json
    python benchmarks/npu_check_kernels.py --fake          # CPU smoke test of this script against the test fake

What it runs (all on one NPU, ``torch.npu.synchronize()`` before and after every timed call, wall-clock with
``time.perf_counter``; median and min over ``--iters`` after ``--warmup`` calls):

1. ``fused_attention``: the plugin's own first-use verification (``fused_attention.verify``: small random inputs of the
   real layout, with and without a padded mask) for this device and dtype; then at the real Qwen-Image layout
   (BSND, 24 heads x 128, [text; image] joint sequence), without a mask (batch 1) and with a padded text mask
   (batch 2, the second prompt 32 tokens shorter): stock = vLLM-Omni's ``SDPAImpl.forward_npu``, the plugin's
   ``npu_fusion_attention`` path (``fused_attention.fused_forward``, mask conversion included) and, as the candidate
   it was chosen over, ``npu_fused_infer_attention_score`` (BSND, same mask and scale). Accuracy: max abs error
   against float32 SDPA on the same inputs; a path passes when it is finite and within
   ``max(ATOL[dtype], 4 x stock SDPA's own error)`` (ATOL bf16 2^-6, fp16 2^-9) - the rule the plugin uses.
2. ``nz_weights``: ``F.linear`` with ND weights vs the same weights cast by ``npu_format_cast(w, 29)`` (FRACTAL_NZ)
   for the real Qwen-Image projections (img_mod 3072->18432 on 1 token; to_qkv 3072->9216, to_out 3072->3072,
   mlp up 3072->12288 and down 12288->3072 on all image tokens); checks ``get_npu_format`` is 29 after the cast and 2
   after casting back, that the round trip is lossless, and NZ accuracy against float32 with the same rule.
   ``torch.npu.config.allow_internal_format`` is set True first, as vLLM-Omni's NPU platform does in ``set_device``.
3. ``rope`` (if the rope optimization exposes ``verify_kernel``): its ``npu_rotary_mul(interleave)`` verification at
   D=128, 24 heads.

What it prints, exactly: a header line ``npu_check_kernels: <device name> | <torch_npu version> | dtype <dtype> |
B=1 S=<txt>+<img> N=<heads> D=<head_dim>``; then one table per section with the columns
``check | case | result | max|err| | tol | median ms | min ms | vs stock`` where result is ``PASS``, ``FAIL`` (with
the reason on the next line) or ``n/a`` (kernel missing in this torch_npu, or an input the kernel refuses, with the
error), and ``vs stock`` is stock median / path median (> 1 = faster than stock); then ``RESULT: PASS (n checks)`` or
``RESULT: FAIL (k of n checks failed: names)``. Exit status 0 when everything passed, 1 when a check failed.

Without torch_npu (or without a visible NPU) it prints ``SKIPPED: <reason> - nothing to check on this machine`` and
exits 0. ``--fake`` runs everything against ``tests/fake_torch_npu`` on CPU with small shapes (a smoke test of the
script: its numbers are not measurements). ``--json PATH`` also writes every row as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Checker:
    """Collects rows, prints tables, decides the result."""

    COLS = ("check", "case", "result", "max|err|", "tol", "median ms", "min ms", "vs stock")
    WIDTHS = (44, 18, 6, 9, 9, 10, 9, 8)

    def __init__(self, device: torch.device, iters: int, warmup: int) -> None:
        self.device, self.iters, self.warmup = device, iters, warmup
        self.rows: list[dict[str, Any]] = []

    def sync(self) -> None:
        from vllm_omni_ascend_opt import _backend

        _backend.synchronize(self.device)

    def time(self, fn: Callable[[], Any]) -> tuple[float, float]:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.iters):
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times), min(times)

    def section(self, title: str) -> None:
        print(f"\n== {title} ==")
        print("  ".join(f"{c:<{w}}" for c, w in zip(self.COLS, self.WIDTHS, strict=True)))
        print("-" * (sum(self.WIDTHS) + 2 * (len(self.WIDTHS) - 1)))

    def row(self, check: str, case: str, result: str, err: float | None = None, tol: float | None = None,
            med: float | None = None, mn: float | None = None, stock_med: float | None = None, why: str = "") -> None:  # fmt: skip
        ratio = (stock_med / med) if (stock_med and med) else None
        cells = (
            check,
            case,
            result,
            "" if err is None else f"{err:.3g}",
            "" if tol is None else f"{tol:.3g}",
            "" if med is None else f"{med:.3f}",
            "" if mn is None else f"{mn:.3f}",
            "" if ratio is None else f"{ratio:.2f}x",
        )
        print("  ".join(f"{c:<{w}}" for c, w in zip(cells, self.WIDTHS, strict=True)))
        if why:
            print(f"    {why}")
        self.rows.append(dict(zip(self.COLS, cells, strict=True)) | {"why": why})

    def failed(self) -> list[str]:
        return [f"{r['check']} [{r['case']}]" for r in self.rows if r["result"] == "FAIL"]


def _tol(dtype: torch.dtype, stock_err: float) -> float:
    from vllm_omni_ascend_opt.opts import fused_attention as fa

    return max(fa.ATOL[dtype], fa.STOCK_ERROR_FACTOR * stock_err)


def _err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.float() - ref).abs().max().item() if bool(torch.isfinite(out).all()) else math.inf


# ----------------------------------------------------------------------------------------------------------------
# 1. attention
# ----------------------------------------------------------------------------------------------------------------
def check_attention(ck: Checker, npu: Any, dtype: torch.dtype, n: int, d: int, txt: int, img: int) -> None:
    from vllm_omni.diffusion.attention.backends.abstract import AttentionMetadata

    from vllm_omni_ascend_opt.opts import fused_attention as fa

    dev = ck.device
    ck.section(f"fused_attention: {fa.KERNEL} vs stock SDPA (BSND, N={n}, D={d}, S={txt}+{img})")
    v = fa.verify(npu, dev, dtype, n, d)
    ck.row("plugin verification (fused_attention.verify)", "small, both", "PASS" if v.ok else "FAIL",
           max(v.errors.values(), default=None), why="" if v.ok else v.detail)  # fmt: skip
    scale = d**-0.5
    stock = fa._sdpa_impl(n, d, scale, n)
    gen = torch.Generator().manual_seed(0)
    for case, b in (("no mask", 1), ("padded mask", 2)):
        s = txt + img
        q, k, val = (torch.randn(b, s, n, d, generator=gen).to(dev) for _ in range(3))
        meta = keep = None
        if b == 2:
            keep = torch.ones(b, s, dtype=torch.bool)
            keep[1, txt - 32 : txt] = False
            keep = keep.to(dev)
            meta = AttentionMetadata(attn_mask=keep)
        ref = fa.reference_attention(q, k, val, keep, scale)  # float32, explicit matmul/softmax
        qd, kd, vd = (x.to(dtype) for x in (q, k, val))
        del q, k, val
        out = stock.forward_npu(qd, kd, vd, meta)
        stock_err = _err(out, ref)
        tol = _tol(dtype, stock_err)
        med, mn = ck.time(lambda qd=qd, kd=kd, vd=vd, meta=meta: stock.forward_npu(qd, kd, vd, meta))
        ck.row("stock: SDPAImpl.forward_npu", case, "ref", stock_err, None, med, mn, med)
        stock_med = med

        def fused(qd=qd, kd=kd, vd=vd, meta=meta):
            out, why = fa.fused_forward(npu, qd, kd, vd, meta, scale)
            if out is None:
                raise ValueError(f"not fusable: {why}")
            return out

        _candidate(ck, f"plugin: {fa.KERNEL}", case, fused, ref, tol, stock_med)
        masked = fa.kernel_mask(meta.attn_mask, b, s, s)[0] if meta is not None else None
        fia = getattr(npu, "npu_fused_infer_attention_score", None)
        if fia is None:
            ck.row("candidate: npu_fused_infer_attention_score", case, "n/a", why="not in this torch_npu")
        else:

            def fia_call(qd=qd, kd=kd, vd=vd, masked=masked, fia=fia):
                return fia(qd, kd, vd, num_heads=n, num_key_value_heads=n, input_layout="BSND", scale=scale,
                           atten_mask=masked, sparse_mode=0)[0]  # fmt: skip

            _candidate(ck, "candidate: npu_fused_infer_attention_score", case, fia_call, ref, tol, stock_med)
        del ref, qd, kd, vd


def _candidate(ck: Checker, name: str, case: str, fn: Callable[[], torch.Tensor], ref: torch.Tensor, tol: float,
               stock_med: float) -> None:  # fmt: skip
    try:
        out = fn()
    except Exception as exc:  # report the refusal, keep checking the rest
        ck.row(name, case, "n/a", why=f"{exc.__class__.__name__}: {str(exc)[:200]}")
        return
    err = _err(out, ref)
    ok = tuple(out.shape) == tuple(ref.shape) and err <= tol
    med, mn = ck.time(fn)
    ck.row(name, case, "PASS" if ok else "FAIL", err, tol, med, mn, stock_med,
           why="" if ok else f"max|err| {err:.3g} > tol {tol:.3g} or wrong shape {tuple(out.shape)}")  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# 2. NZ weights
# ----------------------------------------------------------------------------------------------------------------
def check_nz(ck: Checker, npu: Any, dtype: torch.dtype, hidden: int, img: int) -> None:
    from vllm_omni_ascend_opt.opts import nz_weights as nzw

    ck.section(f"nz_weights: F.linear, ND vs FRACTAL_NZ ({nzw.ACL_FORMAT_FRACTAL_NZ}) weights, hidden {hidden}")
    cfg = getattr(torch.npu, "config", None)
    if cfg is not None and getattr(cfg, "allow_internal_format", None) is not True:
        print("    setting torch.npu.config.allow_internal_format = True (as vLLM-Omni's NPU platform does)")
        cfg.allow_internal_format = True
    h = hidden
    layers = [  # (name, out, in, tokens): the real Qwen-Image projections
        ("img_mod (SiLU->Linear)", 6 * h, h, 1),
        ("attn.to_qkv", 3 * h, h, img),
        ("attn.to_out", h, h, img),
        ("img_mlp up", 4 * h, h, img),
        ("img_mlp down", h, 4 * h, img),
    ]
    gen = torch.Generator().manual_seed(1)
    for name, n_out, k_in, tokens in layers:
        case = f"{n_out}x{k_in}, {tokens} tok"
        w32 = (torch.randn(n_out, k_in, generator=gen) * k_in**-0.5).to(ck.device)
        x32 = torch.randn(tokens, k_in, generator=gen).to(ck.device)
        ref = torch.nn.functional.linear(x32, w32)
        w, x = w32.to(dtype), x32.to(dtype)
        del w32, x32
        out_nd = torch.nn.functional.linear(x, w)
        nd_err = _err(out_nd, ref)
        med, mn = ck.time(lambda x=x, w=w: torch.nn.functional.linear(x, w))
        ck.row(f"stock: ND {name}", case, "ref", nd_err, None, med, mn, med)
        stock_med = med
        try:
            w_nz = npu.npu_format_cast(w, nzw.ACL_FORMAT_FRACTAL_NZ)
            fmt = npu.get_npu_format(w_nz)
            back = npu.npu_format_cast(w_nz, nzw.ACL_FORMAT_ND)
            fmt_back = npu.get_npu_format(back)
            lossless = bool(torch.equal(back, w))
        except Exception as exc:
            ck.row(f"plugin: NZ {name}", case, "FAIL", why=f"npu_format_cast raised {exc.__class__.__name__}: {exc}")
            continue
        if fmt != nzw.ACL_FORMAT_FRACTAL_NZ or fmt_back != nzw.ACL_FORMAT_ND or not lossless:
            ck.row(f"plugin: NZ {name}", case, "FAIL",
                   why=f"format after cast {fmt} (want 29), after revert {fmt_back} (want 2), lossless {lossless}")  # fmt: skip
            continue
        _candidate(ck, f"plugin: NZ {name}", case, lambda x=x, w_nz=w_nz: torch.nn.functional.linear(x, w_nz),
                   ref, _tol(dtype, nd_err), stock_med)  # fmt: skip
        del w, x, w_nz, back, ref, out_nd


# ----------------------------------------------------------------------------------------------------------------
# 3. rope (optional)
# ----------------------------------------------------------------------------------------------------------------
def check_rope(ck: Checker, npu: Any, dtype: torch.dtype, n: int, d: int) -> None:
    try:
        from vllm_omni_ascend_opt.opts import rope
    except ImportError:
        return
    verify_kernel = getattr(rope, "verify_kernel", None)
    kernel = getattr(npu, "npu_rotary_mul", None)
    if not callable(verify_kernel):
        return
    ck.section("rope: npu_rotary_mul(interleave), the rope optimization's own verification")
    if kernel is None:
        ck.row("rope.verify_kernel", f"D={d}", "n/a", why="npu_rotary_mul not in this torch_npu")
        return
    v = verify_kernel(kernel, ck.device, dtype, d, n)
    ok = bool(getattr(v, "ok", False))
    ck.row("rope.verify_kernel", f"D={d}, N={n}", "PASS" if ok else "FAIL",
           why=v.describe() if hasattr(v, "describe") else repr(v))  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--img-tokens", type=int, default=None, help="image tokens (default 4096; --fake: 256)")
    p.add_argument("--txt-tokens", type=int, default=None, help="text tokens (default 256; --fake: 40)")
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=None, help="DiT hidden size for the NZ shapes (default 3072)")
    p.add_argument("--iters", type=int, default=None, help="timed calls per path (default 20; --fake: 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 5; --fake: 1)")
    p.add_argument("--fake", action="store_true", help="CPU smoke test against tests/fake_torch_npu")
    p.add_argument("--json", type=Path, default=None, help="also write all rows as JSON")
    p.add_argument("--fake-variant", action="append", default=[], metavar="KERNEL=VARIANT",
                   help="with --fake: a deliberately wrong fake kernel, e.g. fusion_attention=wrong_polarity")  # fmt: skip
    a = p.parse_args(argv)
    small = a.fake
    img = a.img_tokens or (256 if small else 4096)
    txt = a.txt_tokens or (40 if small else 256)
    hidden = a.hidden or (256 if small else 3072)
    iters = a.iters or (2 if small else 20)
    warmup = a.warmup if a.warmup is not None else (1 if small else 5)
    dtype = DTYPES[a.dtype]

    patcher = None
    if a.fake:
        import pytest

        # Import vLLM-Omni before the fake exists: its imports probe find_spec("torch_npu") (accelerate).
        import vllm_omni.diffusion.attention.backends.sdpa  # noqa: F401

        sys.path.insert(0, str(REPO))
        from tests.fake_torch_npu import install

        patcher = pytest.MonkeyPatch()
        install(patcher, **dict(v.split("=", 1) for v in a.fake_variant))
    try:
        return _run(a, dtype, img, txt, hidden, iters, warmup)
    finally:
        if patcher is not None:
            patcher.undo()
            from vllm_omni_ascend_opt import _backend

            _backend.reset_cache()


def _run(a: argparse.Namespace, dtype: torch.dtype, img: int, txt: int, hidden: int, iters: int, warmup: int) -> int:
    from vllm_omni_ascend_opt import _backend

    npu = _backend.torch_npu_module()
    if npu is None:
        print(f"SKIPPED: {'; '.join(_backend.npu_unavailable_reasons())} - nothing to check on this machine")
        return 0
    device = torch.device("cpu") if a.fake else _backend.npu_device()
    if not a.fake:
        torch.npu.set_device(device)
    name = torch.npu.get_device_name(device.index or 0) if hasattr(torch.npu, "get_device_name") else "?"
    print(f"npu_check_kernels: {name} | {_backend.backend_label()} | dtype {str(dtype).removeprefix('torch.')} | "
          f"B=1 S={txt}+{img} N={a.heads} D={a.head_dim}" + ("  [--fake: CPU smoke test, not a measurement]" if a.fake else ""))  # fmt: skip
    ck = Checker(device, iters, warmup)
    with torch.no_grad():
        check_attention(ck, npu, dtype, a.heads, a.head_dim, txt, img)
        check_nz(ck, npu, dtype, hidden, img)
        check_rope(ck, npu, dtype, a.heads, a.head_dim)
    failed = ck.failed()
    n = sum(r["result"] in ("PASS", "FAIL") for r in ck.rows)
    print()
    print(
        f"RESULT: FAIL ({len(failed)} of {n} checks failed: {', '.join(failed)})"
        if failed
        else f"RESULT: PASS ({n} checks)"
    )
    if a.json:
        a.json.write_text(json.dumps({"device": name, "backend": _backend.backend_label(), "rows": ck.rows}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
