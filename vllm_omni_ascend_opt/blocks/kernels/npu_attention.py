"""The ``npu_fusion_attention`` kernel path that replaces vLLM-Omni's SDPA: the call, the mask, the limits, the checks.

Plain functions (:func:`call_kernel`, :func:`kernel_mask`, :func:`limits_violation`, :func:`fused_forward`) so that
``benchmarks/`` run the plugin's own code; ``fused_attention`` owns the path's verdicts. Checks, against an fp32
reference (:func:`class_errors`) with stock SDPA's own error as the budget, ``max|fused - ref| <= max(ATOL[dtype],
4 * max|sdpa - ref|)``: on first use per (device, dtype), small random BSND [text; image] inputs of the layer's
Nq/Nkv/D, with and without a padded 2-D key mask; on the first real call of each :func:`shape_class`, random inputs of
the call's shapes (production shapes tile differently). Candidates per class (:data:`CALLS`): this kernel in BSND (as
diffusers' ``_native_npu`` backend and vLLM-Omni's NPU flash path call it) and in BNSD, and
``npu_fused_infer_attention_score`` [OP-FIA]; the fastest correct one that beats stock SDPA wins (:mod:`.timing`).
SDPA runs outside the [OP-FA] limits (:func:`limits_violation`), for float32 (bitwise stock), causal calls, masks
other than bool B1SS/11SS or 2-D, and in graph mode.
"""

from __future__ import annotations

import functools
import importlib
import time
from types import ModuleType
from typing import Any

import torch

from vllm_omni_ascend_opt.blocks.kernels.guard import bucket, is_error
from vllm_omni_ascend_opt.blocks.kernels.verdicts import Verdict
from vllm_omni_ascend_opt.blocks.kernels.verified import Candidate, KernelPath
from vllm_omni_ascend_opt.blocks.upstream import targets as _targets

KERNEL = "npu_fusion_attention"
FUSED_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 768  # [OP-FA] D 1..768
MAX_HEADS = 256  # [OP-FA] Nq 1..256
MAX_SEQ = 1 << 20  # [OP-FA] S 1..1M
MAX_BATCH = 2 << 20  # [OP-FA] B 1..2M
#: Verification tolerance floor (max abs error against float32 SDPA), per dtype: 4 ulp at 1.0 for bf16 / fp16.
ATOL = {torch.bfloat16: 2.0**-6, torch.float16: 2.0**-9, torch.float32: 1e-5}
#: ... or this many times the stock SDPA's own error in the same dtype, whichever is larger.
STOCK_ERROR_FACTOR = 4.0
#: Verification inputs: [text; image] joint sequence lengths (text padded in the masked case).
VERIFY_TXT, VERIFY_IMG, VERIFY_PAD = 7, 40, 3
#: Shape-class check: at most this many fp32 scores per chunk of the reference (heads x query rows x Skv).
VERIFY_CHUNK_ELEMS = 1 << 24


def kernel_mask(attn_mask: torch.Tensor | None, b: int, sq: int, skv: int) -> tuple[torch.Tensor | None, str]:
    """SDPA keep-mask (True = attend; 2-D [B, Skv] bool or 0/1, or bool [B|1, 1, 1|Sq, Skv]) -> the kernel's B1SS/11SS
    bool mask (True = masked out) [OP-FA], or (None, why) for another form (float masks stay with SDPA)."""
    if attn_mask is None:
        return None, ""
    shape = tuple(attn_mask.shape)
    if shape == (b, skv):
        masked = ~attn_mask if attn_mask.dtype == torch.bool else attn_mask == 0
        return masked.view(b, 1, 1, skv).expand(b, 1, sq, skv).contiguous(), ""
    bool_4d = attn_mask.dtype == torch.bool and len(shape) == 4 and shape[0] in (1, b)
    if bool_4d and shape[1:] in ((1, 1, skv), (1, sq, skv)):
        return (~attn_mask).expand(shape[0], 1, sq, skv).contiguous(), ""
    return None, f"mask {shape} {attn_mask.dtype}"


def call_kernel(
    npu: ModuleType,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    masked: torch.Tensor | None,
    scale: float,
    layout: str = "BSND",
) -> torch.Tensor:
    """``npu_fusion_attention`` on BSND q/k/v run in ``layout`` (BSND or BNSD) [OP-FA]; ``masked``: True = excluded."""
    bnsd = layout == "BNSD"
    qkv = ((x.transpose(1, 2) if bnsd else x).contiguous() for x in (q, k, v))
    out = npu.npu_fusion_attention(*qkv, q.shape[2], input_layout=layout, atten_mask=masked, scale=scale,
                                   keep_prob=1.0, sparse_mode=0, inner_precise=0)[0]  # fmt: skip
    return out.transpose(1, 2) if bnsd else out


def call_fia(
    npu: ModuleType, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """``npu_fused_infer_attention_score`` on BSND q/k/v (mask: True = excluded, [B|1, 1, Sq, Skv]) [OP-FIA]."""
    return npu.npu_fused_infer_attention_score(
        q.contiguous(), k.contiguous(), v.contiguous(), atten_mask=masked, num_heads=q.shape[2], scale=scale,
        input_layout="BSND", num_key_value_heads=k.shape[2],
    )[0]  # fmt: skip


def stock_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: torch.Tensor | None, scale: float) -> Any:
    """Stock SDPA on BSND q/k/v (the timing's baseline)."""
    import torch.nn.functional as F

    keep = None if masked is None else ~masked
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    gqa = q.shape[2] != k.shape[2]
    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=keep, scale=scale, enable_gqa=gqa).transpose(1, 2)


#: candidate name -> its call on BSND q/k/v
CALLS = {"npu_fusion_attention": call_kernel,
         "npu_fusion_attention/BNSD": functools.partial(call_kernel, layout="BNSD"),
         "npu_fused_infer_attention_score": call_fia}  # fmt: skip


def limits_violation(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """Why BSND q/k/v fall outside the documented limits [OP-FA] or our dtype policy ("" when they fit)."""
    if q.dtype not in FUSED_DTYPES:
        return f"dtype {str(q.dtype).removeprefix('torch.')}"
    if not (q.dtype == k.dtype == v.dtype):
        return "mixed dtypes"
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        return "not BSND / key and value shapes differ"
    b, sq, nq, d = q.shape
    bk, skv, nkv, dk = k.shape
    if b != bk or not 1 <= b <= MAX_BATCH:
        return "batch"
    if d != dk or not 1 <= d <= MAX_HEAD_DIM:
        return f"head dim {d} (1..{MAX_HEAD_DIM}, Dq == Dk)"
    if not 1 <= nq <= MAX_HEADS or nkv < 1 or nq % nkv:
        return f"heads {nq}/{nkv} (Nq 1..{MAX_HEADS}, Nq % Nkv == 0)"
    if not (1 <= sq <= MAX_SEQ and 1 <= skv <= MAX_SEQ):
        return "sequence length (1..1M)"
    return ""


def fused_forward(
    npu: ModuleType, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_metadata: Any, scale: float | None
) -> tuple[torch.Tensor | None, str]:
    """The fused replacement of ``SDPAImpl._forward_impl`` for BSND q/k/v: ``(out, "")`` or ``(None, why not)``."""
    why = limits_violation(q, k, v)
    mask = getattr(attn_metadata, "attn_mask", None)
    masked, why = (None, why) if why else kernel_mask(mask, q.shape[0], q.shape[1], k.shape[1])
    if why:
        return None, why
    return call_kernel(npu, q, k, v, masked, float(scale if scale is not None else q.shape[-1] ** -0.5)), ""


def shape_class(q: torch.Tensor, k: torch.Tensor, masked: torch.Tensor | None) -> tuple:
    """(device, dtype, layout, B*Nq bucket, Nq/Nkv, Sq bucket, Skv bucket, D, masked) of a BSND call: what tiling
    depends on (the GQA group size, not Nkv: a head split divides both; B*Nq bucketed like S)."""
    b, sq, nq, d = q.shape
    skv, nkv = k.shape[1], k.shape[2]
    return (str(q.device), str(q.dtype).removeprefix("torch."), "BSND", bucket(b * nq), nq // max(1, nkv), bucket(sq),
            bucket(skv), d, masked is not None)  # fmt: skip


def class_errors(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, masked: torch.Tensor | None, scale: float
) -> tuple[float, float, bool]:
    """(max |out - ref_fp32|, max |stock SDPA - ref_fp32|, out finite) for real BSND q/k/v, in chunks of heads and
    query rows. ``masked``: the kernel's mask (True = excluded, [B|1, 1, Sq, Skv]) or None."""
    import torch.nn.functional as F

    b, sq, nq, _ = q.shape
    skv, nkv = k.shape[1], k.shape[2]
    qt, kt, vt, ot = (x.transpose(1, 2) for x in (q, k, v, out))  # BNSD views
    if nq != nkv:  # GQA: query head h reads kv head h // (Nq / Nkv)
        kt, vt = kt.repeat_interleave(nq // nkv, dim=1), vt.repeat_interleave(nq // nkv, dim=1)
    heads = max(1, min(nq, VERIFY_CHUNK_ELEMS // max(1, b * sq * skv)))
    rows = max(1, min(sq, VERIFY_CHUNK_ELEMS // max(1, b * heads * skv)))
    err = err_stock = 0.0
    finite = True
    for h in range(0, nq, heads):
        kh, vh = kt[:, h : h + heads], vt[:, h : h + heads]
        for r in range(0, sq, rows):
            qc = qt[:, h : h + heads, r : r + rows]
            keep = None if masked is None else ~masked[:, :, r : r + rows]
            sc = torch.matmul(qc.float(), kh.float().transpose(-1, -2)) * scale
            if keep is not None:
                sc = sc.masked_fill(~keep, float("-inf"))
            ref = torch.matmul(torch.softmax(sc, dim=-1), vh.float())
            del sc
            got = ot[:, h : h + heads, r : r + rows].float()
            finite = finite and bool(torch.isfinite(got).all())
            err = max(err, float((got - ref).abs().max()))
            stock = F.scaled_dot_product_attention(qc, kh, vh, attn_mask=keep, scale=scale)
            err_stock = max(err_stock, float((stock.float() - ref).abs().max()))
    return err, err_stock, finite


def _judged(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, masked: torch.Tensor | None, scale: float
) -> tuple[bool, str, float, float]:
    """(ok, why, kernel error, stock error) of ``out`` by :func:`class_errors`, stock SDPA's error as the budget."""
    err, err_stock, finite = class_errors(q, k, v, out, masked, scale)
    tol = max(ATOL.get(q.dtype, 1e-2), STOCK_ERROR_FACTOR * err_stock)
    ok = finite and err <= tol
    why = f"max|fused - ref_fp32| {err:.3g} {'<=' if ok else '>'} tol {tol:.3g} (stock SDPA error {err_stock:.3g})"
    return ok, why if finite else "non-finite output; " + why, err, err_stock


def _raised_or(fn: Any, *args: Any) -> tuple[Any, str]:
    """``fn(*args)`` -> (out, why); a kernel that rejects the call gives (None, what it raised); errors propagate."""
    try:
        return fn(*args)
    except Exception as exc:
        if is_error(exc):
            raise
        return None, f"kernel raised {exc.__class__.__name__}: {exc}"


def sdpa_impl(num_heads: int, head_dim: int, scale: float, num_kv_heads: int) -> Any:
    sdpa = importlib.import_module(_targets.SDPA_BACKEND)
    return sdpa.SDPAImpl(
        num_heads=num_heads, head_size=head_dim, softmax_scale=scale, causal=False, num_kv_heads=num_kv_heads
    )


class AttentionPath(KernelPath):
    """``npu_fusion_attention`` in BSND for the attention impls ``fused_attention`` swaps."""

    kernel = KERNEL
    candidates = (
        Candidate("npu_fusion_attention", "close"),
        Candidate("npu_fusion_attention/BNSD", "close", "npu_fusion_attention"),
        Candidate("npu_fused_infer_attention_score", "close"),
    )

    def place(self, key: tuple) -> str:
        if len(key) == 2:
            return f"{key[0]}/{key[1]}"
        dev, dtype, layout, bn, group, sq, skv, d, masked = key
        return f"{dev}/{dtype}/{layout} B*N<={bn} Nq/Nkv={group} Sq<={sq} Skv<={skv} D={d}{' masked' if masked else ''}"

    def first_check(
        self,
        npu: ModuleType,
        device: torch.device | str,
        dtype: torch.dtype,
        num_heads: int,
        head_dim: int,
        *,
        num_kv_heads: int | None = None,
        scale: float | None = None,
    ) -> Verdict:
        """The fused path on random BSND inputs against the fp32 reference: batch 1 without a mask, and batch 2 whose
        second prompt has ``VERIFY_PAD`` padded text tokens (vLLM-Omni's 2-D key mask)."""
        from vllm_omni.diffusion.attention.backends.abstract import AttentionMetadata

        nkv, scale, device = num_kv_heads or num_heads, float(scale or head_dim**-0.5), torch.device(device)
        key, s = (str(device), str(dtype).removeprefix("torch.")), VERIFY_TXT + VERIFY_IMG
        gen = torch.Generator().manual_seed(20260829)
        errors: dict[str, float] = {}
        for case, b in (("no mask", 1), ("padded mask", 2)):
            q, k, v = (torch.randn(b, s, n, head_dim, generator=gen).to(device, dtype) for n in (num_heads, nkv, nkv))
            keep = None
            if b == 2:
                keep = torch.ones(b, s, dtype=torch.bool, device=device)
                keep[1, VERIFY_TXT - VERIFY_PAD : VERIFY_TXT] = False  # [text; image]: the 2nd prompt is shorter
            out, why = _raised_or(fused_forward, npu, q, k, v, AttentionMetadata(attn_mask=keep), scale)
            if out is None:
                return self.verdict(key, False, f"{case}: not fusable ({why})", errors=errors)
            ok, why, errors[case], _ = _judged(q, k, v, out, kernel_mask(keep, b, s, s)[0], scale)
            if tuple(out.shape) != tuple(q.shape) or not ok:
                return self.verdict(key, False, f"{case}: {why}", errors=errors)
        detail = ", ".join(f"{c}: max|Δ| {e:.3g}" for c, e in errors.items())
        return self.verdict(key, True, f"{detail} (Nq={num_heads}, Nkv={nkv}, D={head_dim})", errors=errors)

    def class_check(
        self,
        npu: ModuleType,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        masked: torch.Tensor | None,
        scale: Any,
        call: Any = call_kernel,
    ) -> Verdict:
        """The candidate ``call`` on random inputs of this call's shapes, dtype and mask against the fp32 reference
        (random data exercises every tile; real activations can be degenerate)."""
        t0 = time.perf_counter()
        key = shape_class(q, k, masked)
        s = float(scale) if scale is not None else q.shape[-1] ** -0.5
        gen = torch.Generator().manual_seed(0x5A5A)
        qr, kr, vr = (torch.randn(x.shape, generator=gen).to(device=x.device, dtype=x.dtype) for x in (q, k, v))
        out, why = _raised_or(lambda: (call(npu, qr, kr, vr, masked, s), ""))
        if out is None:
            return self.verdict(key, False, why)
        ok, why, err, err_stock = _judged(qr, kr, vr, out, masked, s)
        facts = {"errors": {"kernel": err, "stock": err_stock}, "seconds": time.perf_counter() - t0}
        return self.verdict(key, ok, why, **facts)

    def more(self, npu: ModuleType, q: Any, k: Any, v: Any, masked: Any, scale: Any) -> tuple:
        """The further candidates this torch_npu has, as :meth:`KernelPath.call` takes them."""
        s = float(scale) if scale is not None else q.shape[-1] ** -0.5
        return tuple(
            (c.name, lambda f=CALLS[c.name]: f(npu, q, k, v, masked, s),
             lambda _out, f=CALLS[c.name]: self.class_check(npu, q, k, v, masked, scale, f))
            for c in self.candidates[1:] if hasattr(npu, c.op or c.name)
        )  # fmt: skip


def check_scratch_bytes(q: torch.Tensor, k: torch.Tensor) -> int:
    """Device scratch of the class check: random q/k/v and the output, and a few fp32 chunks of scores."""
    b, sq, nq, _ = q.shape
    io = (2 * q.numel() + 2 * k.numel()) * q.element_size()
    scores = min(VERIFY_CHUNK_ELEMS, b * nq * sq * k.shape[1])
    return io + 3 * 4 * scores + 3 * 4 * q.numel()
