#!/usr/bin/env python
"""Check the plugin's Ascend kernels on this machine and time them against the stock path: one command, one table.

Usage (on an Ascend host with torch_npu, vLLM 0.30 and vLLM-Omni 0.30 installed, from the repo root)::

    python benchmarks/npu_check_kernels.py                 # bf16, Qwen-Image layout: B=1, 4096 image + 256 text
    python benchmarks/npu_check_kernels.py --dtype fp16 --img-tokens 6400 --iters 50 --out check.json
    python benchmarks/npu_check_kernels.py --fake          # CPU smoke test of this script against the test fake

What it runs (all on one NPU, ``torch.npu.synchronize()`` before and after every timed call, wall-clock with
``time.perf_counter``; median and min over ``--iters`` after ``--warmup`` calls). Every section applies the runtime's
own policies and ends with what the plugin *would* use on this machine (``plugin would use`` rows: PASS = the plugin
takes the kernel, FAIL = it would refuse it, with the reason) - a kernel that passes a check here is not "in use"
unless that row says so.

1. ``fused_attention``: the plugin's first-use verification (``AttentionPath.first_check``, toy shapes); then at the
   production shapes - BSND, 24 heads x 128, [text; image] joint sequence S = 256 + 4096 = 4352, B*N = 24 (batch 1,
   no mask) and 48 (batch 2, the second prompt 32 tokens shorter) - the plugin's per-shape-class check
   (``AttentionPath.class_check``: chunked fp32 reference, stock SDPA as the error budget; its one-time cost is
   printed), and timings of: stock ``SDPAImpl.forward_npu`` (permutes to BNSD, expands the mask, calls
   ``F.scaled_dot_product_attention``, which torch_npu (torch >= 2.5 builds) dispatches to ``npu_fusion_attention``
   BNSD itself); ``F.scaled_dot_product_attention`` alone on pre-permuted contiguous BNSD inputs (the kernel stock
   already gets, without the copies); the plugin's path (BSND, no copies, mask built once per forward - timed with
   the mask prebuilt); and the candidate ``npu_fused_infer_attention_score``. The difference between the first and
   the third is what ``fused_attention`` saves on a current stack: the permute/contiguous copies and the mask
   expansion, not a faster attention kernel.
2. ``nz_weights``: the plugin's gates - torch_npu / CANN versions (``nz_check.version_reasons``), the trial cast
   that establishes the internal-format permission (``torch.npu.config`` is write-only: it is set True as vLLM-Omni's
   NPU platform does, never read), and the first-use numerical check (3-D ``addmm`` with bias and bias-free
   ``matmul``, ``nz_check.check_nz_linear``); then the real Qwen-Image projections as the model runs them: 3-D
   ``F.linear`` with bias on [1, tokens, in] (img_mod on 1 token; to_qkv, to_out, mlp up/down on all image tokens),
   ND vs FRACTAL_NZ weights, format round trip checked.
3. ``rope``: the kernel policy (``VLLM_OMNI_ASCEND_OPT_ROPE_KERNEL``: ``pixel`` default, ``bitwise``), the toy-shape
   verification (``RotaryPath.first_check``), then at the production shapes (S = 4352, B*N = 24 and 48,
   D = 128) the per-shape-class check (``RotaryPath.class_check``, chunked fp32 reference, error no larger than
   stock's own) with its one-time cost, and timings of ``npu_rotary_mul`` vs the portable path.

What it prints: a header line ``npu_check_kernels: <chip> | soc <version> | torch_npu <version> | CANN <version> |
dtype <dtype> | S=<txt>+<img> N=<heads> D=<head_dim>``; one table per section with the columns
``check | case | result | max|err| | tol | median ms | min ms | vs stock`` (``vs stock`` = stock median / path
median, > 1 = faster than stock); then ``RESULT: PASS (n checks)`` or ``RESULT: FAIL (k of n checks failed: ...)``
and ``JSON: <path>``. The JSON (``--out PATH``, also spelled ``--json``; default
``out/npu-check/npu_check_kernels.json`` under the repository root, a git-ignored folder) holds the header facts,
every row, and ``would_use`` per optimization. Exit status 0 when everything passed, 1 otherwise.

Without torch_npu (or without a visible NPU) it prints ``SKIPPED: <reason> - nothing to check on this machine`` and
exits 0. ``--fake`` runs everything against ``tests/fake_torch_npu`` on CPU with small shapes by default (a smoke test
of the script: its numbers are not measurements); ``--fake --img-tokens 4096 --txt-tokens 256 --iters 1 --warmup 0``
measures the fake's own cost of the per-shape-class checks at the production shapes on CPU.
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
#: Where the JSON goes without ``--out``: an ignored folder (``/out/`` in .gitignore), never the repository root.
DEFAULT_JSON = REPO / "out" / "npu-check" / "npu_check_kernels.json"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Checker:
    """Collects rows, prints tables, decides the result."""

    COLS = ("check", "case", "result", "max|err|", "tol", "median ms", "min ms", "vs stock")
    WIDTHS = (44, 18, 6, 9, 9, 10, 9, 8)

    def __init__(self, device: torch.device, iters: int, warmup: int) -> None:
        self.device, self.iters, self.warmup = device, iters, warmup
        self.rows: list[dict[str, Any]] = []
        self.would_use: dict[str, Any] = {}

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
    from vllm_omni_ascend_opt.blocks.kernels import npu_attention as fa

    return max(fa.ATOL[dtype], fa.STOCK_ERROR_FACTOR * stock_err)


def _err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.float() - ref).abs().max().item() if bool(torch.isfinite(out).all()) else math.inf


# ----------------------------------------------------------------------------------------------------------------
# 1. attention
# ----------------------------------------------------------------------------------------------------------------
def check_attention(ck: Checker, npu: Any, dtype: torch.dtype, n: int, d: int, txt: int, img: int) -> None:
    import torch.nn.functional as F
    from vllm_omni.diffusion.attention.backends.abstract import AttentionMetadata

    from vllm_omni_ascend_opt.blocks.kernels import npu_attention as fa

    dev = ck.device
    ck.section(f"fused_attention: {fa.KERNEL} vs stock SDPA (BSND, N={n}, D={d}, S={txt}+{img})")
    from collections import Counter

    path = fa.AttentionPath("npu_check_kernels", Counter())
    v = path.first_check(npu, dev, dtype, n, d)
    ck.row("plugin verification (AttentionPath.first_check)", "toy, both", "PASS" if v.ok else "FAIL",
           max(v.errors.values(), default=None), why="" if v.ok else v.reason)  # fmt: skip
    scale = d**-0.5
    stock = fa.sdpa_impl(n, d, scale, n)
    gen = torch.Generator().manual_seed(0)
    would = {}
    for case, b in ((f"B*N={n}, no mask", 1), (f"B*N={2 * n}, padded", 2)):
        s = txt + img
        q, k, val = (torch.randn(b, s, n, d, generator=gen).to(device=dev, dtype=dtype) for _ in range(3))
        meta = None
        if b == 2:
            keep = torch.ones(b, s, dtype=torch.bool)
            keep[1, max(0, txt - 32) : txt] = False
            meta = AttentionMetadata(attn_mask=keep.to(dev))
        masked = fa.kernel_mask(meta.attn_mask, b, s, s)[0] if meta is not None else None
        med, mn = ck.time(lambda q=q, k=k, val=val, meta=meta: stock.forward_npu(q, k, val, meta))
        ck.row("stock: SDPAImpl.forward_npu", case, "ref", None, None, med, mn, med)
        stock_med = med
        qb, kb, vb = (x.transpose(1, 2).contiguous() for x in (q, k, val))
        keep4 = None if masked is None else ~masked
        med, mn = ck.time(
            lambda qb=qb, kb=kb, vb=vb, m=keep4: F.scaled_dot_product_attention(qb, kb, vb, attn_mask=m, scale=scale)
        )
        ck.row("stock kernel only: F.sdpa on BNSD", case, "info", None, None, med, mn, stock_med,
               why="what torch_npu dispatches stock's call to (npu_fusion_attention BNSD), without stock's copies")  # fmt: skip
        del qb, kb, vb
        try:
            out = fa.call_kernel(npu, q, k, val, masked, scale)
            sv = path.class_check(npu, q, k, val, masked, scale)
        except Exception as exc:
            ck.row("plugin would use npu_fusion_attention", case, "FAIL", why=f"{exc.__class__.__name__}: {exc}")
            would[case] = False
            continue
        would[case] = sv.ok
        ck.row("plugin would use npu_fusion_attention", case, "PASS" if sv.ok else "FAIL", sv.errors.get("kernel"),
               None, sv.seconds * 1e3, None, why=f"per-shape-class check (one-time cost in 'median ms'): {sv.reason}")  # fmt: skip
        med, mn = ck.time(lambda q=q, k=k, val=val, masked=masked: fa.call_kernel(npu, q, k, val, masked, scale))
        ck.row(f"plugin: {fa.KERNEL} (mask prebuilt)", case, "info", None, None, med, mn, stock_med)
        fia = getattr(npu, "npu_fused_infer_attention_score", None)
        if fia is None:
            ck.row("candidate: npu_fused_infer_attention_score", case, "n/a", why="not in this torch_npu")
        else:

            def fia_call(q=q, k=k, val=val, masked=masked, fia=fia):
                return fia(q, k, val, num_heads=n, num_key_value_heads=n, input_layout="BSND", scale=scale,
                           atten_mask=masked, sparse_mode=0)[0]  # fmt: skip

            _candidate(ck, "candidate: npu_fused_infer_attention_score", case, fia_call, out, fa.ATOL[dtype], stock_med)
        del q, k, val, out
    ck.would_use["fused_attention"] = {"ok": v.ok and all(would.values()), "per_shape": would}


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
    from vllm_omni_ascend_opt import _backend
    from vllm_omni_ascend_opt.blocks.kernels import nz_check as nzw

    ck.section(f"nz_weights: 3-D F.linear with bias, ND vs FRACTAL_NZ ({nzw.ACL_FORMAT_FRACTAL_NZ}), hidden {hidden}")
    cfg = getattr(torch.npu, "config", None)
    if cfg is not None:
        print("    torch.npu.config.allow_internal_format = True (as vLLM-Omni's NPU platform does; write-only)")
        cfg.allow_internal_format = True
    h = hidden
    versions = nzw.version_reasons(npu)
    ck.row("plugin gate: torch_npu / CANN versions", f"CANN {_backend.cann_version()}", "FAIL" if versions else "PASS",
           why="; ".join(versions))  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    probe = (torch.randn(3 * h, h, generator=gen) * h**-0.5).to(device=ck.device, dtype=dtype)
    nz, why = nzw.trial_cast(npu, probe)
    ck.row("plugin gate: trial cast (permission)", f"{3 * h}x{h}", "FAIL" if nz is None else "PASS", why=why)
    numbers = False
    if nz is not None:
        numbers, detail = nzw.check_nz_linear(probe, nz)
        ck.row("plugin gate: first-use numeric check", f"{3 * h}x{h}", "PASS" if numbers else "FAIL", why=detail)
    would = not versions and nz is not None and numbers
    ck.would_use["nz_weights"] = {"ok": would, "versions": versions, "permission": why or "ok"}
    ck.row("plugin would use NZ weights", "", "PASS" if would else "FAIL",
           why="" if would else "the plugin keeps ND weights here (see the gates above)")  # fmt: skip
    del probe, nz
    layers = [  # (name, out, in, tokens): the real Qwen-Image projections, as 3-D F.linear with bias
        ("img_mod (SiLU->Linear)", 6 * h, h, 1),
        ("attn.to_qkv", 3 * h, h, img),
        ("attn.to_out", h, h, img),
        ("img_mlp up", 4 * h, h, img),
        ("img_mlp down", h, 4 * h, img),
    ]
    for name, n_out, k_in, tokens in layers:
        case = f"{n_out}x{k_in}, {tokens} tok"
        w32 = (torch.randn(n_out, k_in, generator=gen) * k_in**-0.5).to(ck.device)
        b32 = (torch.randn(n_out, generator=gen) * 0.1).to(ck.device)
        x32 = torch.randn(1, tokens, k_in, generator=gen).to(ck.device)
        ref = torch.nn.functional.linear(x32, w32, b32)
        w, bias, x = w32.to(dtype), b32.to(dtype), x32.to(dtype)
        del w32, b32, x32
        out_nd = torch.nn.functional.linear(x, w, bias)
        nd_err = _err(out_nd, ref)
        med, mn = ck.time(lambda x=x, w=w, bias=bias: torch.nn.functional.linear(x, w, bias))
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
        _candidate(ck, f"plugin: NZ {name}", case,
                   lambda x=x, w_nz=w_nz, bias=bias: torch.nn.functional.linear(x, w_nz, bias),
                   ref, _tol(dtype, nd_err), stock_med)  # fmt: skip
        del w, x, w_nz, back, ref, out_nd


# ----------------------------------------------------------------------------------------------------------------
# 3. rope (optional)
# ----------------------------------------------------------------------------------------------------------------
def check_rope(ck: Checker, npu: Any, dtype: torch.dtype, n: int, d: int, seq: int) -> None:
    from collections import Counter

    from vllm_omni_ascend_opt.blocks.kernels import rope_tables, rotary
    from vllm_omni_ascend_opt.opts import rope

    policy = "bitwise" if rope.OPT.requires_bitwise() else "pixel"
    ck.section(f"rope: npu_rotary_mul(interleave) under the runtime policy {rope.ENV_KERNEL_POLICY}={policy}")
    kernel = getattr(npu, "npu_rotary_mul", None)
    if kernel is None:
        ck.row("RotaryPath.first_check", f"D={d}", "FAIL", why="npu_rotary_mul not in this torch_npu")
        ck.would_use["rope"] = {"ok": False, "tier": "exact", "why": "no npu_rotary_mul"}
        return
    path = rotary.RotaryPath(rope.OPT, Counter(), "npu_check_kernels")  # rope's policy, a path of its own
    v = path.first_check(kernel, ck.device, dtype, d, n)
    toy_ok = v.ok
    ck.row("plugin verification (RotaryPath.first_check)", f"toy, D={d}", "PASS" if toy_ok else "FAIL",
           v.errors.get("kernel"), v.errors.get("stock"), why=v.describe())  # fmt: skip
    gen = torch.Generator().manual_seed(2)
    would = {}
    for b in (1, 2):
        case = f"B*N={b * n}, S={seq}"
        x = (torch.randn(b, seq, n, d, generator=gen) * 3).to(device=ck.device, dtype=dtype)
        theta = torch.rand(seq, d // 2, generator=gen, dtype=torch.float64) * 6.283
        freqs = torch.polar(torch.ones_like(theta), theta).to(torch.complex64).to(ck.device)
        tables = rope_tables.Tables(dtype)
        cos, sin_signed = rope_tables.portable_tables(tables, freqs, Counter())
        npu_cos, npu_sin = rope_tables.npu_tables(tables, freqs, Counter())
        med, mn = ck.time(lambda x=x, c=cos, s=sin_signed: rope_tables.apply_portable(x, c, s))
        ck.row("stock math: portable path (4 launches)", case, "ref", None, None, med, mn, med)
        stock_med = med
        try:
            out = kernel(x, npu_cos, npu_sin, rotary_mode="interleave")
            sv = path.class_check(x, out, cos, sin_signed)
        except Exception as exc:
            ck.row("plugin would use npu_rotary_mul", case, "FAIL", why=f"{exc.__class__.__name__}: {exc}")
            would[case] = False
            continue
        would[case] = toy_ok and sv.ok
        ck.row("plugin would use npu_rotary_mul", case, "PASS" if would[case] else "FAIL",
               sv.errors.get("kernel"), sv.errors.get("stock"), sv.seconds * 1e3, None,
               why=f"per-shape-class check (one-time cost in 'median ms'): {sv.describe()}")  # fmt: skip
        med, mn = ck.time(lambda x=x, c=npu_cos, s=npu_sin: kernel(x, c, s, rotary_mode="interleave"))
        ck.row("plugin: npu_rotary_mul (1 launch)", case, "info", None, None, med, mn, stock_med)
        del x, out
    ok = toy_ok and all(would.values())
    ck.would_use["rope"] = {"ok": ok, "tier": ("pixel" if policy == "pixel" else "exact") if ok else "exact",
                            "policy": policy, "per_shape": would}  # fmt: skip


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
    p.add_argument("--out", "--json", dest="json", type=Path, default=DEFAULT_JSON,
                   help=f"where to write the JSON beside the table (default {DEFAULT_JSON.relative_to(REPO)})")  # fmt: skip
    p.add_argument("--fake-variant", action="append", default=[], metavar="KERNEL=VARIANT",
                   help="with --fake: a deliberately wrong fake kernel, e.g. fusion_attention=wrong_polarity")  # fmt: skip
    p.add_argument("--fake-cann", default="8.3.RC1", help="with --fake: the CANN version the fake reports")
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
        install(patcher, cann_version=a.fake_cann, **dict(v.split("=", 1) for v in a.fake_variant))
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
    soc = _soc_version()
    facts = {"chip": name, "soc_version": soc, "torch_npu": str(getattr(npu, "__version__", "?")),
             "cann": _backend.cann_version(), "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."),
             "txt_tokens": txt, "img_tokens": img, "heads": a.heads, "head_dim": a.head_dim, "fake": bool(a.fake)}  # fmt: skip
    print(f"npu_check_kernels: {name} | soc {soc} | torch_npu {facts['torch_npu']} | CANN {facts['cann']} | "
          f"dtype {facts['dtype']} | S={txt}+{img} N={a.heads} D={a.head_dim}"
          + ("  [--fake: CPU run of the test fake, not a device measurement]" if a.fake else ""))  # fmt: skip
    ck = Checker(device, iters, warmup)
    with torch.no_grad():
        check_attention(ck, npu, dtype, a.heads, a.head_dim, txt, img)
        check_nz(ck, npu, dtype, hidden, img)
        check_rope(ck, npu, dtype, a.heads, a.head_dim, txt + img)
    failed = ck.failed()
    n = sum(r["result"] in ("PASS", "FAIL") for r in ck.rows)
    print()
    print(
        f"RESULT: FAIL ({len(failed)} of {n} checks failed: {', '.join(failed)})"
        if failed
        else f"RESULT: PASS ({n} checks)"
    )
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({**facts, "would_use": ck.would_use, "rows": ck.rows}, indent=1))
    print(f"JSON: {a.json}")
    return 1 if failed else 0


def _soc_version() -> Any:
    """The chip's SoC version (torch_npu's ``torch_npu.npu._backends.get_soc_version`` / the fake's), or None."""
    for getter in (getattr(torch.npu, "get_soc_version", None),):
        if getter is not None:
            try:
                return getter()
            except Exception:
                return None
    try:
        from torch_npu.npu._backends import get_soc_version

        return get_soc_version()
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
