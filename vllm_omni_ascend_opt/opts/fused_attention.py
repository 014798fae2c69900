"""`fused_attention`: Run the joint text+image attention with torch_npu.npu_fusion_attention (BSND), verified against SDPA on first use.

Why
    Without MindIE-SD, vLLM-Omni 0.30 on Ascend resolves Qwen-Image's attention to its TORCH_SDPA backend
    (``platforms/npu/platform.py`` ``get_diffusion_attn_backend_cls``), whose ``SDPAImpl.forward_npu`` permutes Q/K/V
    to BNSD, expands a 2-D key mask to [B, 1, Sq, Skv] and calls ``F.scaled_dot_product_attention``. The reference
    910B1 ablation measured 27-49 ms per image for replacing it with the fused Ascend kernel.
How
    Per model instance, never process-wide: :meth:`FusedAttention.attach` finds every ``QwenImageCrossAttention`` of
    the model and swaps its ``attn`` layer's implementation object (``Attention.attention``, an ``SDPAImpl``) for an
    instance of a per-class subclass whose ``forward`` calls ``torch_npu.npu_fusion_attention`` (BSND,
    ``head_num`` = Nq, ``scale`` = the layer's ``softmax_scale`` = 1/sqrt(D) - the kernel's default is 1 - and the
    keep-mask inverted: the kernel masks where True, SDPA keeps where True; no mask when vLLM-Omni dropped an
    all-true mask). ``detach`` puts the original object back by identity. The ``Attention`` layer keeps its parallel
    strategy, so Ulysses' ``pre_attention`` (all-to-all + joint concat) and ``post_attention`` run around the fused
    call exactly as around SDPA. Ring attention never reaches the impl (``Attention._run_ring_attention`` runs
    ``RingParallelAttention``'s own kernels), so ring layers are left alone and counted as skipped. Any call the
    kernel cannot take (float32, causal, an unsupported mask, a limit below) goes to the original SDPA object.
What it saves over torch_npu's own SDPA
    Since its torch >= 2.5 builds, torch_npu already dispatches ``F.scaled_dot_product_attention`` on Atlas A2 to
    ``npu_fusion_attention`` (BNSD). So on a current stack this optimization does **not** bring a faster attention
    kernel: it saves what stock's ``SDPAImpl.forward_npu`` does around it - the three BSND->BNSD permutes with their
    ``.contiguous()`` copies of Q/K/V, the BNSD->BSND copy of the output, and the [B, 1, S, S] mask expansion per
    layer (built here once per transformer forward, see "Mask" below). ``benchmarks/npu_check_kernels.py`` times both
    at the production shape and prints the difference; the reference 910B1 figure (27-49 ms per image) predates it.
Mask
    The kernel's [B, 1, Sq, Skv] bool mask is built once per transformer forward and reused by every layer: vLLM-Omni
    builds the joint 2-D mask from the same inputs in every block (``torch.cat`` of the text and image masks), so
    within one forward its values are the same; a forward pre-hook on each attached ``QwenImageTransformer2DModel``
    starts a new mask generation. Outside an attached transformer's forward the mask is built per call.
Verification
    On first use per (device, dtype) the fused path runs on small random inputs of the real layout (BSND, [text; image]
    joint sequence, the layer's Nq/Nkv/D) with and without a padded 2-D key mask, against a float32 reference computed
    by explicit matmul/softmax (:func:`reference_attention`, independent of any SDPA or fused kernel), with vLLM-Omni's
    own ``SDPAImpl._forward_impl(..., mask_mode="full_qk")`` (the stock NPU path) in the same dtype as the error
    budget. It is accepted when ``max|fused - ref_fp32| <= max(ATOL[dtype], 4 * max|sdpa_dtype - ref_fp32|)`` with
    ATOL bfloat16 2^-6, float16 2^-9, and every output is finite. Otherwise it stays off for that (device, dtype) with the
    errors in :meth:`FusedAttention.reasons_inactive`; a kernel error at run time does the same.
    Then, on the first real call of each shape class (device, dtype, layout, B*Nq, Nkv, Sq and Skv buckets = next
    power of two, D, masked or not) the kernel's output on the real inputs is compared with an fp32 reference
    computed in chunks of heads and query rows (:data:`VERIFY_CHUNK_ELEMS` scores at a time), with stock SDPA on the
    same chunks as the error budget (same rule as above). A class that fails, or whose first call raises, goes to
    SDPA with the reason logged and shown in ``reasons_inactive``; production shapes (S ~ 4352, B*N 24-48: other
    tilings than the toy check) are thus checked where they run.
Kernel choice
    ``npu_fusion_attention`` over ``npu_fused_infer_attention_score`` (FIA): (1) it is the kernel the reference
    ablation measured, and the one diffusers' ``_native_npu`` backend (``attention_dispatch.py``, BSND,
    ``scale=1/sqrt(D)``, mask inverted) and vLLM-Omni 0.30's own NPU flash path (``flash_attn.py``
    ``forward_fa_npu``) call for inference on this data; (2) its documented caveat ("training only, no graph mode")
    does not bite: Qwen-Image runs eagerly on NPU in vLLM-Omni 0.30, so FIA's graph-mode support buys nothing;
    (3) its limits are wider: D 1..768 with no alignment or contiguity rule, fp16/bf16/fp32 [OP-FA], versus FIA's
    D <= 512 and 16-aligned, non-contiguous inputs unsupported, fp16/bf16 [OP-FIA]. ``benchmarks/npu_check_kernels.py``
    verifies and times FIA next to it at the real layout, so the choice can be revisited with device numbers.
Documented limits encoded (checked per call; outside them SDPA runs)
    [OP-FA] = Ascend/op-plugin ``docs/context/torch_npu-npu_fusion_attention.md``; [OP-FIA] =
    ``docs/context/torch_npu-npu_fused_infer_attention_score.md``.
    D (head dim) 1..768 and Dq == Dk == Dv [OP-FA]; Nq 1..256 and Nq % Nkv == 0 [OP-FA]; B 1..2M, Sq/Skv 1..1M
    [OP-FA]; key.shape == value.shape [OP-FA]; q/k/v of one dtype, used for float16/bfloat16 only (our policy:
    float32 models stay bitwise stock); non-causal only; atten_mask bool, B1SS/11SS [OP-FA]; no graph mode
    ("暂不支持图模式" [OP-FA]: under torch.compile tracing or NPU graph capture SDPA runs); inputs made contiguous
    (no-op for the contiguous Q/K/V the model and Ulysses produce), as vLLM-Omni's own NPU call does.
Upstream PR
    None. vLLM-Omni fuses NPU attention only through MindIE-SD's FLASH_ATTN backend.
Removal plan
    Drop when ``SDPAImpl.forward_npu`` calls ``npu_fusion_attention`` itself or MindIE-SD is the default backend.
"""

from __future__ import annotations

import importlib
import logging
import math
import sys
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, ClassVar

import torch
import torch.nn as nn

from vllm_omni_ascend_opt import _backend
from vllm_omni_ascend_opt.blocks import targets as _targets
from vllm_omni_ascend_opt.optimization import Optimization

logger = logging.getLogger("vllm_omni_ascend_opt")

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


@dataclass(frozen=True)
class Verdict:
    """Outcome of the on-device check for one (device, dtype)."""

    ok: bool
    device: str
    dtype: str
    backend: str
    detail: str
    errors: dict[str, float] = field(default_factory=dict)
    module_id: int = 0

    def describe(self) -> str:
        state = "verified" if self.ok else "FAILED verification"
        return f"{KERNEL} {state} on {self.device}/{self.dtype} ({self.backend}): {self.detail}"


# ----------------------------------------------------------------------------------------------------------------
# the fused call (one function, used by the forward and by the verification)
# ----------------------------------------------------------------------------------------------------------------
def kernel_mask(attn_mask: torch.Tensor | None, b: int, sq: int, skv: int) -> tuple[torch.Tensor | None, str]:
    """SDPA keep-mask (True = attend) -> the kernel's B1SS/11SS bool mask (True = masked out) [OP-FA].

    Returns ``(mask, "")``, or ``(None, why)`` when the mask has a form this path does not translate (SDPA runs).
    Handles what vLLM-Omni's SDPA path handles for Qwen-Image: a 2-D [B, Skv] key mask (bool or 0/1), and bool 4-D
    [B|1, 1, 1|Sq, Skv] masks. Float (additive) masks are left to SDPA.
    """
    if attn_mask is None:
        return None, ""
    if attn_mask.dim() == 2 and tuple(attn_mask.shape) == (b, skv):
        masked = ~attn_mask if attn_mask.dtype == torch.bool else attn_mask == 0
        return masked.view(b, 1, 1, skv).expand(b, 1, sq, skv).contiguous(), ""
    if (
        attn_mask.dim() == 4
        and attn_mask.dtype == torch.bool
        and attn_mask.shape[0] in (1, b)
        and attn_mask.shape[1] == 1
        and attn_mask.shape[2] in (1, sq)
        and attn_mask.shape[3] == skv
    ):
        return (~attn_mask).expand(attn_mask.shape[0], 1, sq, skv).contiguous(), ""
    return None, f"mask {tuple(attn_mask.shape)} {attn_mask.dtype}"


def call_kernel(
    npu: ModuleType, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """``npu_fusion_attention`` on BSND q/k/v; returns BSND output [OP-FA]. ``masked``: True = excluded."""
    return npu.npu_fusion_attention(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        q.shape[2],
        input_layout="BSND",
        atten_mask=masked,
        scale=scale,
        keep_prob=1.0,
        sparse_mode=0,
        inner_precise=0,
    )[0]


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
    npu: ModuleType,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_metadata: Any,
    scale: float | None,
    masks: Any = None,
) -> tuple[torch.Tensor | None, str]:
    """The fused replacement of ``SDPAImpl._forward_impl`` for BSND q/k/v: ``(out, "")`` or ``(None, why not)``.

    ``masks``: a callable ``(attn_mask, b, sq, skv) -> (mask, why)`` (the per-forward cache), else :func:`kernel_mask`."""
    why = limits_violation(q, k, v)
    if why:
        return None, why
    mask = getattr(attn_metadata, "attn_mask", None) if attn_metadata is not None else None
    masked, why = (masks or kernel_mask)(mask, q.shape[0], q.shape[1], k.shape[1])
    if why:
        return None, why
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return call_kernel(npu, q, k, v, masked, float(scale)), ""


# ----------------------------------------------------------------------------------------------------------------
# verification against vLLM-Omni's SDPA
# ----------------------------------------------------------------------------------------------------------------
def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None, scale: float, heads_per_chunk: int = 8
) -> torch.Tensor:
    """float32 attention by explicit matmul / softmax (no SDPA, no fused kernel): the independent reference.

    q/k/v BSND (GQA allowed), ``keep`` an SDPA-style 2-D [B, Skv] keep-mask or None; returns float32 BSND. Heads are
    processed ``heads_per_chunk`` at a time to bound the [B, n, Sq, Skv] score memory at the real layout.
    """
    qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k, v))
    if kf.shape[1] != qf.shape[1]:
        rep = qf.shape[1] // kf.shape[1]
        kf, vf = kf.repeat_interleave(rep, dim=1), vf.repeat_interleave(rep, dim=1)
    outs = []
    for h in range(0, qf.shape[1], heads_per_chunk):
        sc = torch.matmul(qf[:, h : h + heads_per_chunk], kf[:, h : h + heads_per_chunk].transpose(-1, -2)) * scale
        if keep is not None:
            sc = sc.masked_fill(~keep.bool()[:, None, None, :], float("-inf"))
        outs.append(torch.matmul(torch.softmax(sc, dim=-1), vf[:, h : h + heads_per_chunk]))
    return torch.cat(outs, dim=1).transpose(1, 2)


def shape_class(q: torch.Tensor, k: torch.Tensor, masked: torch.Tensor | None) -> tuple:
    """(device, dtype, layout, B*Nq, Nkv, Sq bucket, Skv bucket, D, masked) of a BSND call: what tiling depends on."""
    b, sq, nq, d = q.shape
    skv, nkv = k.shape[1], k.shape[2]
    bucket = lambda n: 1 << max(0, (n - 1).bit_length())  # noqa: E731
    return (str(q.device), str(q.dtype).removeprefix("torch."), "BSND", b * nq, nkv, bucket(sq), bucket(skv), d,
            masked is not None)  # fmt: skip


@dataclass
class ShapeVerdict:
    """Outcome of checking the kernel on the first real call of one shape class."""

    key: tuple
    ok: bool
    detail: str
    err: float = math.nan
    err_stock: float = math.nan
    seconds: float = 0.0

    def describe(self) -> str:
        dev, dtype, layout, bn, nkv, sq, skv, d, masked = self.key
        where = f"{dev}/{dtype}/{layout} B*N={bn} Nkv={nkv} Sq<={sq} Skv<={skv} D={d}{' masked' if masked else ''}"
        state = "verified" if self.ok else "FAILED"
        return f"{KERNEL} {state} at {where}: {self.detail}"


def check_at_shape(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, masked: torch.Tensor | None, scale: float
) -> ShapeVerdict:
    """The kernel's ``out`` for real BSND q/k/v against an fp32 reference, in chunks of heads and query rows.

    ``masked``: the kernel's mask (True = excluded, [B|1, 1, Sq, Skv]) or None. The error budget is stock SDPA in
    q's dtype on the same chunks: ``max|out - ref| <= max(ATOL[dtype], STOCK_ERROR_FACTOR * max|sdpa - ref|)``."""
    import torch.nn.functional as F

    t0 = time.perf_counter()
    key = shape_class(q, k, masked)
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
    tol = max(ATOL.get(q.dtype, 1e-2), STOCK_ERROR_FACTOR * err_stock)
    ok = finite and err <= tol
    detail = f"max|fused - ref_fp32| {err:.3g} {'<=' if ok else '>'} tol {tol:.3g} (stock SDPA error {err_stock:.3g})"
    if not finite:
        detail = "non-finite output; " + detail
    _backend.synchronize(q.device if q.device.type != "cpu" else None)
    return ShapeVerdict(key, ok, detail + f"; check took {(time.perf_counter() - t0) * 1e3:.0f} ms", err, err_stock,
                        time.perf_counter() - t0)  # fmt: skip


def _sdpa_impl(num_heads: int, head_dim: int, scale: float, num_kv_heads: int) -> Any:
    sdpa = importlib.import_module(_targets.SDPA_BACKEND)
    return sdpa.SDPAImpl(
        num_heads=num_heads, head_size=head_dim, softmax_scale=scale, causal=False, num_kv_heads=num_kv_heads
    )


def verify(
    npu: ModuleType,
    device: torch.device | str,
    dtype: torch.dtype,
    num_heads: int,
    head_dim: int,
    *,
    num_kv_heads: int | None = None,
    scale: float | None = None,
    seq_txt: int = VERIFY_TXT,
    seq_img: int = VERIFY_IMG,
) -> Verdict:
    """Check the fused path against vLLM-Omni's SDPA (stock NPU path) on random BSND inputs of the real layout.

    Two cases: batch 1 without a mask, and batch 2 whose second prompt has ``VERIFY_PAD`` padded text tokens (the 2-D
    [B, S_txt + S_img] key mask vLLM-Omni builds). See the module docstring for the tolerance.
    """
    from vllm_omni.diffusion.attention.backends.abstract import AttentionMetadata

    nkv = num_kv_heads or num_heads
    scale = float(scale if scale is not None else head_dim**-0.5)
    device = torch.device(device)
    dname = str(dtype).removeprefix("torch.")
    label = _backend.backend_label()
    stock = _sdpa_impl(num_heads, head_dim, scale, nkv)
    gen = torch.Generator().manual_seed(20260829)
    s = seq_txt + seq_img
    errors: dict[str, float] = {}
    worst = ""
    try:
        for case, b in (("no mask", 1), ("padded mask", 2)):
            q = torch.randn(b, s, num_heads, head_dim, generator=gen)
            k = torch.randn(b, s, nkv, head_dim, generator=gen)
            v = torch.randn(b, s, nkv, head_dim, generator=gen)
            meta = keep = None
            if case == "padded mask":
                keep = torch.ones(b, s, dtype=torch.bool)
                keep[1, seq_txt - VERIFY_PAD : seq_txt] = False  # [text; image]: the 2nd prompt is shorter
                keep = keep.to(device)
                meta = AttentionMetadata(attn_mask=keep)
            qd, kd, vd = (x.to(device=device, dtype=dtype) for x in (q, k, v))
            out, why = fused_forward(npu, qd, kd, vd, meta, scale)
            if out is None:
                return Verdict(False, str(device), dname, label, f"{case}: not fusable ({why})", errors, id(npu))
            ref = reference_attention(*(x.to(device) for x in (q, k, v)), keep, scale)
            same = stock._forward_impl(qd, kd, vd, meta, mask_mode="full_qk").float()
            err = (out.float() - ref).abs().max().item() if torch.isfinite(out).all() else float("inf")
            err_stock = (same - ref).abs().max().item()
            tol = max(ATOL.get(dtype, 1e-2), STOCK_ERROR_FACTOR * err_stock)
            errors[case] = err
            if tuple(out.shape) != tuple(q.shape) or not err <= tol:
                worst = (
                    f"{case}: max|fused - sdpa_fp32| = {err:.3g} > tol {tol:.3g} (stock {dname} error {err_stock:.3g})"
                )
                return Verdict(False, str(device), dname, label, worst, errors, id(npu))
    except Exception as exc:
        return Verdict(
            False, str(device), dname, label, f"kernel raised {exc.__class__.__name__}: {exc}", errors, id(npu)
        )
    detail = ", ".join(f"{c}: max|Δ| {e:.3g}" for c, e in errors.items())
    return Verdict(
        True, str(device), dname, label, f"{detail} (Nq={num_heads}, Nkv={nkv}, D={head_dim})", errors, id(npu)
    )


def _graph_mode() -> bool:
    """torch.compile tracing or NPU graph capture: [OP-FA] "暂不支持图模式" (no graph mode), so SDPA runs there."""
    return torch.compiler.is_compiling() or _backend.graph_capture_reason() is not None


# ----------------------------------------------------------------------------------------------------------------
# the swapped implementation object
# ----------------------------------------------------------------------------------------------------------------
class _FusedImplMixin:
    """Mixed in front of the stock impl class: ``forward`` takes the fused path when it can, else the stock object."""

    _ascend_opt_stock: Any
    _ascend_opt_calls: Counter

    def forward(self, query, key, value, attn_metadata=None):
        return OPT._forward(self, query, key, value, attn_metadata)


_FUSED_CLASSES: dict[type, type] = {}


def _fused_class(stock_cls: type) -> type:
    cls = _FUSED_CLASSES.get(stock_cls)
    if cls is None:
        cls = type(
            f"AscendFused{stock_cls.__name__}",
            (_FusedImplMixin, stock_cls),
            {"__module__": __name__, "__doc__": f"{stock_cls.__name__} whose forward runs {KERNEL} (BSND)."},
        )
        _FUSED_CLASSES[stock_cls] = cls
    return cls


def _make_fused(stock: Any) -> Any:
    impl = object.__new__(_fused_class(type(stock)))
    impl.__dict__.update({k: v for k, v in stock.__dict__.items() if k != "forward"})  # never shadow our forward
    impl._ascend_opt_stock = stock
    impl._ascend_opt_calls = Counter()
    return impl


@dataclass
class _ModelState:
    layers: list[tuple[nn.Module, Any, Any]] = field(default_factory=list)  # (Attention layer, stock impl, fused)
    hooks: list[Any] = field(default_factory=list)  # forward pre-hook handles (one per transformer)
    skipped: Counter = field(default_factory=Counter)
    dtypes: set[torch.dtype] = field(default_factory=set)
    reasons: list[str] = field(default_factory=list)


class FusedAttention(Optimization):
    name = "fused_attention"
    summary = "Run the joint text+image attention with torch_npu.npu_fusion_attention (BSND), verified against SDPA on first use."
    equivalence = "close"
    default_enabled = True
    requires = ("torch_npu with npu_fusion_attention; an Ascend NPU; fp16/bf16",)
    target_modules = (_targets.TRANSFORMER,)
    parallel_support: ClassVar[dict[str, str]] = {
        "single": "supported",
        "ulysses": "supported",
        "ring": "off: ring attention runs RingParallelAttention's own kernels and never reaches the swapped impl",
        "cfg_parallel": "supported",
        "tensor_parallel": "supported",
        "allgather": (
            "off: all-gather sequence parallelism needs vLLM-Omni's TRTLLM_ATTN backend (CUDA), whose impl is not "
            "SDPAImpl: its layers are left alone"
        ),
        "vae_patch_parallel": "supported",
    }
    regions = frozenset({"block"})
    removal_plan = "Drop when SDPAImpl.forward_npu calls npu_fusion_attention itself or MindIE-SD is the default."

    def __init__(self) -> None:
        super().__init__()
        self._models: weakref.WeakKeyDictionary[nn.Module, _ModelState] = weakref.WeakKeyDictionary()
        self._verdicts: dict[tuple[str, str], Verdict] = {}
        self._shapes: dict[tuple, ShapeVerdict] = {}
        self._shapes_probe = 0
        self._forward_gen = 0  # bumped by the forward pre-hook of every attached transformer
        self._mask_cache: dict[tuple, torch.Tensor] = {}
        self._mask_gen = -1

    # ----- state in words ------------------------------------------------------------------------------------
    def _process_reasons(self) -> list[str]:
        reasons = _backend.npu_unavailable_reasons()
        npu = _backend.torch_npu_module()
        if npu is not None and not hasattr(npu, KERNEL):
            reasons.append(f"{_backend.backend_label()} has no {KERNEL}")
        reasons += [v.describe() + "; SDPA kept" for v in self._verdicts.values() if not v.ok]
        reasons += [v.describe() + "; SDPA for this shape class" for v in self._current_shapes() if not v.ok]
        return reasons

    def _current_shapes(self) -> list[ShapeVerdict]:
        return list(self._shapes.values()) if self._shapes_probe == _backend.probe_id() else []

    def shape_verdicts(self) -> list[ShapeVerdict]:
        """The per-shape-class checks of the kernel on real calls so far."""
        return self._current_shapes()

    def mask_for(self, attn_mask: torch.Tensor | None, b: int, sq: int, skv: int) -> tuple[torch.Tensor | None, str]:
        """:func:`kernel_mask`, built once per transformer forward (see the module docstring, "Mask")."""
        if attn_mask is None or self._forward_gen == 0:
            return kernel_mask(attn_mask, b, sq, skv)
        if self._mask_gen != self._forward_gen:
            self._mask_cache.clear()
            self._mask_gen = self._forward_gen
        key = (tuple(attn_mask.shape), attn_mask.dtype, str(attn_mask.device), b, sq, skv)
        hit = self._mask_cache.get(key)
        if hit is not None:
            self.stats["mask_reuses"] += 1
            return hit, ""
        masked, why = kernel_mask(attn_mask, b, sq, skv)
        if masked is not None:
            self._mask_cache[key] = masked
            self.stats["mask_builds"] += 1
        return masked, why

    def _new_forward(self, module: nn.Module, args: Any) -> None:
        """Forward pre-hook of an attached transformer: a new forward, so masks are built afresh."""
        self._forward_gen += 1

    def _model_reasons(self, model: nn.Module) -> list[str]:
        state = self._models.get(model)
        if state is None:
            return ["not attached to this model"]
        reasons = list(state.reasons)
        if not state.layers:
            skipped = ", ".join(f"{k}: {n}" for k, n in state.skipped.items()) or "none found"
            reasons.append(f"no joint-attention layer takes the fused path (skipped: {skipped})")
        odd = sorted(str(d).removeprefix("torch.") for d in state.dtypes if d not in FUSED_DTYPES)
        if odd:
            reasons.append(
                f"the transformer runs in {', '.join(odd)}: {KERNEL} is used for float16/bfloat16 only, SDPA runs"
            )
        reasons += [v.describe() + "; SDPA kept" for v in self._verdicts.values() if not v.ok]
        return reasons

    def notes(self) -> list[str]:
        out = [
            f"kernel: torch_npu.{KERNEL}(q, k, v, head_num=Nq, input_layout='BSND', atten_mask=~keep (B1SS) or None, "
            "scale=softmax_scale=1/sqrt(D), keep_prob=1, sparse_mode=0, inner_precise=0); chosen over "
            "npu_fused_infer_attention_score (see module docstring); installed per Attention impl, after Ulysses' "
            "all-to-all"
        ]
        out += [v.describe() for v in self._verdicts.values() if v.ok]
        out += [v.describe() for v in self._current_shapes() if v.ok]
        if self.stats:
            out.append(
                f"[B,1,S,S] masks built {self.stats['mask_builds']}, reused {self.stats['mask_reuses']} (once per "
                "transformer forward, not per layer); saves vs torch_npu's own SDPA dispatch (which also runs "
                "npu_fusion_attention, BNSD): the Q/K/V/output permute copies and the per-layer mask expansion"
            )
        return out

    def verdicts(self) -> dict[tuple[str, str], Verdict]:
        """The on-device verification outcome per (device, dtype) so far."""
        return dict(self._verdicts)

    def report(self, model: nn.Module) -> dict[str, Any]:
        """Per model: swapped layers, skipped layers by reason, and calls per path (``fused`` / ``sdpa: why``)."""
        state = self._models.get(model)
        if state is None:
            return {"swapped": 0, "skipped": {}, "calls": {}}
        calls: Counter = Counter()
        for _layer, _stock, fused in state.layers:
            calls.update(fused._ascend_opt_calls)
        return {"swapped": len(state.layers), "skipped": dict(state.skipped), "calls": dict(calls)}

    # ----- attach / detach --------------------------------------------------------------------------------------
    def _uninstall(self) -> None:
        self._verdicts.clear()
        self._shapes.clear()
        self._mask_cache.clear()

    def _attach(self, model: nn.Module) -> None:
        npu = _backend.torch_npu_module()
        state = _ModelState()
        self._models[model] = state
        if npu is None:
            state.reasons = _backend.npu_unavailable_reasons()
            return
        transformer_mod = sys.modules.get(_targets.TRANSFORMER)
        cross_cls = getattr(transformer_mod, "QwenImageCrossAttention", None)
        sdpa_cls = getattr(sys.modules.get(_targets.SDPA_BACKEND), "SDPAImpl", None)
        if cross_cls is None or sdpa_cls is None:
            state.reasons = ["vLLM-Omni's Qwen-Image transformer / SDPA backend is not imported"]
            return
        for module in model.modules():
            if not isinstance(module, cross_cls):
                continue
            qkv = getattr(getattr(module, "to_qkv", None), "weight", None)
            if isinstance(qkv, torch.Tensor):
                state.dtypes.add(qkv.dtype)
            layer = getattr(module, "attn", None)
            why = self._layer_skip_reason(layer, sdpa_cls)
            if why:
                state.skipped[why] += 1
                continue
            stock = layer.attention
            fused = _make_fused(stock)
            layer.attention = fused
            state.layers.append((layer, stock, fused))
        tr_cls = getattr(transformer_mod, "QwenImageTransformer2DModel", None)
        if state.layers and tr_cls is not None:
            state.hooks = [
                m.register_forward_pre_hook(self._new_forward) for m in model.modules() if isinstance(m, tr_cls)
            ]

    @staticmethod
    def _layer_skip_reason(layer: Any, sdpa_cls: type) -> str:
        if layer is None or not hasattr(layer, "attention"):
            return "no vLLM-Omni Attention layer"
        if getattr(layer, "_has_custom_attention", False):
            return "model-owned custom attention kernel"
        if getattr(layer, "use_ring", False):
            return "ring sequence parallelism"
        impl = layer.attention
        if isinstance(impl, _FusedImplMixin):
            return "already fused (attached through another model)"
        if type(impl) is not sdpa_cls:  # e.g. FLASH_ATTN (MindIE-SD) or a model-owned override: left alone
            return f"impl {type(impl).__name__} (not vLLM-Omni's SDPAImpl)"
        return ""

    def _detach(self, model: nn.Module) -> None:
        state = self._models.pop(model, None)
        if state is None:
            return
        for handle in state.hooks:
            handle.remove()
        for layer, stock, fused in state.layers:
            if layer.attention is fused:
                layer.attention = stock

    # ----- the forward ------------------------------------------------------------------------------------------
    def _verdict(self, npu: ModuleType, q: torch.Tensor, k: torch.Tensor, scale: float | None) -> Verdict:
        key = (str(q.device), str(q.dtype).removeprefix("torch."))
        verdict = self._verdicts.get(key)
        if verdict is None or verdict.module_id != id(npu):
            verdict = verify(npu, q.device, q.dtype, q.shape[2], q.shape[3], num_kv_heads=k.shape[2], scale=scale)
            self._verdicts[key] = verdict
            log = logger.info if verdict.ok else logger.warning
            log("vllm-omni-ascend-opt: %s", verdict.describe())
        return verdict

    def _forward(self, impl: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_metadata: Any):
        npu = _backend.torch_npu_module()
        why = ""
        if npu is None:
            why = "no torch_npu"
        elif getattr(impl, "causal", False):
            why = "causal"
        elif _graph_mode():
            why = "graph mode"
        else:
            why = limits_violation(query, key, value)
        if not why:
            scale = getattr(impl, "softmax_scale", None)
            if not self._verdict(npu, query, key, scale).ok:
                why = "verification failed"
            else:
                out, why = self._fused_checked(npu, query, key, value, attn_metadata, scale)
                if out is not None:
                    impl._ascend_opt_calls["fused"] += 1
                    return out
        impl._ascend_opt_calls[f"sdpa: {why}"] += 1
        return impl._ascend_opt_stock.forward(query, key, value, attn_metadata)

    @staticmethod
    def _check_class(
        npu: ModuleType, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: torch.Tensor | None, scale: Any
    ) -> ShapeVerdict:
        """Run the kernel on random inputs of this call's exact shapes, dtype and mask, and :func:`check_at_shape`.

        Random data, not the call's own: real activations can be degenerate (a tiny model's q.k barely depends on
        the scale), random ones exercise every element of the tiling."""
        s = float(scale) if scale is not None else q.shape[-1] ** -0.5
        gen = torch.Generator().manual_seed(0x5A5A)
        qr, kr, vr = (torch.randn(x.shape, generator=gen).to(device=x.device, dtype=x.dtype) for x in (q, k, v))
        try:
            out = call_kernel(npu, qr, kr, vr, masked, s)
        except Exception as exc:
            return ShapeVerdict(shape_class(q, k, masked), False, f"kernel raised {exc.__class__.__name__}: {exc}")
        return check_at_shape(qr, kr, vr, out, masked, s)

    def _fused_checked(
        self, npu: ModuleType, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_metadata: Any, scale: Any
    ) -> tuple[torch.Tensor | None, str]:
        """The fused call, checked on the first real call of its shape class; (None, why) sends it to SDPA."""
        if self._shapes_probe != _backend.probe_id():
            self._shapes.clear()
            self._shapes_probe = _backend.probe_id()
        mask = getattr(attn_metadata, "attn_mask", None) if attn_metadata is not None else None
        masked, why = self.mask_for(mask, q.shape[0], q.shape[1], k.shape[1])
        if why:
            return None, why
        key = shape_class(q, k, masked)
        checked = self._shapes.get(key)
        if checked is None:
            checked = self._shapes[key] = self._check_class(npu, q, k, v, masked, scale)
            self.stats["shape_checks"] += 1
            (logger.info if checked.ok else logger.warning)(
                "vllm-omni-ascend-opt: %s%s", checked.describe(), "" if checked.ok else "; SDPA for this shape class"
            )
        if not checked.ok:
            return None, "shape class failed verification"
        try:
            out, why = fused_forward(npu, q, k, v, attn_metadata, scale, masks=lambda *a: (masked, ""))
        except Exception as exc:
            self._shapes[key] = ShapeVerdict(key, False, f"kernel raised {exc.__class__.__name__} at run time: {exc}")
            logger.warning("vllm-omni-ascend-opt: %s; SDPA for this shape class", self._shapes[key].describe())
            return None, "kernel error"
        return out, why


OPT = FusedAttention()
