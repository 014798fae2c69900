"""`fast_residual`: the block's four gated residuals ``x + gate * y`` as ``torch.addcmul(x, gate, y)`` (close tier, 1 ulp bf16; off by default).

Patched upstream symbols
    None of its own: a mode of ``shared_modulation``'s block body (``QwenImageTransformerBlock.forward``), which
    it needs (without it, inactive with a reason).
Why
    Stock adds each gated branch output to its residual stream as ``x + gate * y``: two kernels and a
    ``[B, L, D]`` temporary, four times per block (image/text after attention and after the MLP).
How
    ``torch.addcmul(x, gate, y)``: one kernel per residual (for the edit models' two-segment image stream one per
    broadcast chunk view, or per segment slice with ``out=``). The product is not rounded before the sum (fused
    multiply-add or fp32 opmath), so the result may differ from stock's in the last bit: ``close``, never
    ``exact``. Measured on the tiny model (CPU): fp32 max |diff| 6e-7 with identical uint8 images; bf16 SSIM 0.9993,
    PSNR 52.5 dB vs stock.
Fallbacks (stock's ops, counted with a reason: ``fallback_reasons()``)
    mixed dtypes among ``x``, ``gate`` and ``y`` (stock promotes).
Gates
    SSIM >= 0.999 and PSNR >= 45 dB against the configuration without it (``close_gates``; tests/test_fast_residual.py
    and the ``tiny-cpu-fast`` ablation).
Upstream PR
    None yet. Proposal: ``hidden_states.addcmul(gate, branch)`` in QwenImageTransformerBlock.forward.
Removal plan
    Drop when vLLM-Omni's block writes its gated residuals as one fused op.
"""

from __future__ import annotations

from vllm_omni_ascend_opt.blocks.upstream import targets as _targets
from vllm_omni_ascend_opt.opts._fast_tier import FastBlockMode


class FastResidual(FastBlockMode):
    name = "fast_residual"
    summary = (
        "Gated residuals as torch.addcmul(x, gate, y): 4 fewer kernels per block; a last-bit change (1 ulp bf16), "
        "gated by SSIM >= 0.999 / PSNR >= 45 dB."
    )
    mode = "residual"
    #: What its addcmul replaces: the block's gated residuals ``x + gate * y``.
    upstream = (_targets.BLOCK_FORWARD,)
    removal_plan = "when vLLM-Omni's block writes its gated residuals with one fused op"


OPT = FastResidual()
