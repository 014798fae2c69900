"""FLOPs and bytes of one kernel launch, from its arguments and result: what the device-time model prices.

Kinds: ``gemm`` (matmuls, convolutions), ``attention`` (SDPA and the NPU fused attentions), ``other`` (the rest,
priced by bytes; FLOPs one per output element). A multiply-add is 2 FLOPs; attention is ``4 * B * heads * Sq * Sk * D``
(no softmax). Bytes: each distinct tensor argument read once and each result written once (no cache reuse).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

GEMM, ATTENTION, OTHER = "gemm", "attention", "other"
_GEMM_NAMES = {"addmm", "mm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "addmv", "mv", "dot"}
_ATTENTION_NAMES = {
    "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention",
    "npu::npu_fusion_attention",
    "npu::npu_fused_infer_attention_score",
}


@dataclass(frozen=True)
class Cost:
    kind: str
    flops: float
    bytes: float


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The distinct tensors of ``tree``."""
    return list({id(x): x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)}.values())


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _gemm_flops(b: str, args: tuple[Any, ...], out: Any) -> float:
    outs = _tensors(out)
    o = outs[0].numel() if outs else 0
    if b in ("addmm", "baddbmm", "addbmm", "addmv", "linear"):
        k = args[1].shape[-1]
    elif "conv" in b:
        w = args[1]
        return 2.0 * o * (w.numel() // w.shape[0])
    else:  # mm, bmm, matmul, mv, dot
        k = args[0].shape[-1]
    return 2.0 * o * k


def _attention_flops(b: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    q, k = args[0], args[1]
    if b.startswith("npu::"):
        layout = kwargs.get("input_layout", args[4] if len(args) > 4 else "BSND")
        sk = k.shape[{"BSND": 1, "BSH": 1, "BNSD": 2, "SBH": 0, "TND": 0}.get(layout, 1)]
    else:
        sk = k.shape[-2]
    return 4.0 * q.numel() * sk


def cost(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Cost:
    """The :class:`Cost` of one launch of ``name`` (a counter's op name) with these arguments and result."""
    b = name if name.startswith("npu::") else name.split(".", 1)[0]  # "addmm.out" -> "addmm"
    if b in _ATTENTION_NAMES:
        kind, flops = ATTENTION, _attention_flops(b, args, kwargs)
    elif b in _GEMM_NAMES or "conv" in b:
        kind, flops = GEMM, _gemm_flops(b, args, out)
    else:
        kind, flops = OTHER, float(sum(t.numel() for t in _tensors(out)))
    reads = sum(nbytes(t) for t in _tensors((args, kwargs)))
    writes = sum(nbytes(t) for t in _tensors(out))
    return Cost(kind, flops, float(reads + writes))
