"""`fast_residual`: the block's four gated residuals as ``torch.addcmul`` (:class:`FastResidual`).

A mode of ``shared_modulation``'s block body (``_fast_tier``); mixed dtypes keep stock's ops (counted).
"""

from __future__ import annotations

from vllm_omni_ascend_opt.blocks.body.block_body import FAST_RESIDUAL
from vllm_omni_ascend_opt.blocks.upstream import targets as _targets
from vllm_omni_ascend_opt.opts._fast_tier import FastBlockMode


class FastResidual(FastBlockMode):
    name = "fast_residual"
    summary = "Gated residuals as torch.addcmul(x, gate, y): 4 fewer kernels per block; 1 ulp in bf16 (close tier)."
    why = "Each block writes four gated residuals as x + gate * y: two kernels and a [B, L, D] temporary each."
    how = (
        "torch.addcmul(x, gate, y) when x, gate and y share one dtype (stock promotes mixed dtypes): one kernel "
        "per residual. The product is not rounded before the sum (1 ulp in bf16): close, gated at SSIM >= 0.999 "
        "and PSNR >= 45 dB against the configuration without it."
    )
    upstream_pr = (
        "vllm-omni #7419 (open) fuses the same gated residuals on CUDA in Triton, keeping the eager roundings; this is "
        "torch.addcmul everywhere, opt-in. Proposal: hidden_states.addcmul(gate, branch) in the block forward."
    )
    removal_plan = "Drop when vLLM-Omni's block writes its gated residuals with one fused op."
    slot = FAST_RESIDUAL
    upstream = (_targets.BLOCK_FORWARD,)


OPT = FastResidual()
