"""vLLM-Omni's NPU int8 (``--quantization int8``) priced on the bf16 trace (a model, never a measurement).

``NPUInt8LinearMethod`` runs each quantized linear (the blocks' linears with M > 1; modulation and timestep embedder
stay bf16) as ``npu_dynamic_quant(x)`` then ``npu_quant_matmul``. :func:`int8_table` keeps each such GEMM's FLOPs at
the int8 peak with int8 operand bytes, plus one quantization launch priced by its bytes. The weight layout (NZ int8)
changes neither FLOPs nor bytes, so it is not priced.
"""

from __future__ import annotations

import re

from vllm_omni_ascend_opt.devtime.costs import GEMM, OTHER
from vllm_omni_ascend_opt.devtime.trace import BLOCKS, Op, OpTable

#: int8 peak / bf16 peak: the Da Vinci cube does 8192 INT8 or 4096 FP16 MACs per cycle.
INT8_PEAK_RATIO = 2.0
GEMM_INT8 = "gemm_int8"
QUANT_OP = "npu_dynamic_quant"
_DIMS = re.compile(r"(\d+)x(\d+)")


def gemm_shape(site: str) -> tuple[int, int, int] | None:
    """(M, K, N) of a traced 2-D GEMM from its site's shapes (``addmm``: ``N,MxK,KxN``; ``mm``: ``MxK,KxN``)."""
    dims = _DIMS.findall(site.partition("|")[2])
    if len(dims) < 2:
        return None
    (m, k), (k2, n) = (tuple(map(int, d)) for d in dims[-2:])
    return (m, k, n) if k == k2 else None


def quantized(op: Op, blocks: int = BLOCKS) -> bool:
    """Whether vLLM-Omni's int8 quantizes this GEMM: a per-block linear (launched once per block) with M > 1."""
    shape = gemm_shape(op.site)
    return op.kind == GEMM and shape is not None and shape[0] > 1 and op.count % blocks == 0


def int8_table(table: OpTable, blocks: int = BLOCKS) -> OpTable:
    """``table`` (one bf16 call) as vLLM-Omni's NPU int8 runs it: int8 GEMMs and their dynamic quantizations."""
    out = OpTable()
    for op in table.ops.values():
        if not quantized(op, blocks):
            out.add(op.name, op.kind, op.site, op.flops, op.bytes, op.count)
            continue
        m, k, n = gemm_shape(op.site)  # type: ignore[misc]
        bias = 2 * n if op.name.startswith("addmm") else 0
        gemm_bytes = m * k + k * n + 2 * m * n + 4 * m + 4 * n + bias  # int8 x, w; bf16 out; fp32 scales
        out.add(f"npu_quant_matmul[{op.name}]", GEMM_INT8, op.site, op.flops, gemm_bytes * op.count, op.count)
        quant_bytes = 2 * m * k + m * k + 4 * m  # bf16 in, int8 out, fp32 per-token scale
        out.add(QUANT_OP, OTHER, op.site, 0.0, quant_bytes * op.count, op.count)
    return out
