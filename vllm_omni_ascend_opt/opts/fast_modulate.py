"""`fast_modulate`: AdaLayerNorm's ``LN(x) * (1 + scale) + shift`` as ONE affine layer norm (close tier, 1 ulp bf16; off by default).

Patched upstream symbols
    None of its own: a mode of ``shared_modulation``'s block body (``QwenImageTransformerBlock.forward``), which
    it needs (without it, inactive with a reason).
Why
    Stock applies each of the block's four AdaLayerNorms as a layer norm without affine, then ``* (1 + scale)`` and
    ``+ shift``: 3 kernels per norm in fp32, 5 in bf16 on the native path (``x.float()``, layer norm, cast back,
    mul, add) -- 12-20 launches per block, 60 blocks, every step.
How
    Where the modulation is the same for every token of a sample (single-segment blocks; batch 1, or every batch
    row equal), ``F.layer_norm(x, (D,), weight=1 + scale, bias=shift, eps)`` -- on an NPU without MindIE-SD
    ``torch_npu.npu_layer_norm_eval(x, [D], weight, bias, eps)`` (the kernel stock's ``forward_npu`` already calls,
    [OP-LNE]) -- one kernel per norm. The ``[D]`` weight and bias are views of shared_modulation's memoized
    ``(1 + scale, shift)``, built on first use and kept with the memo entry, so a warm step pays no extra op.
    The affine runs in the kernel's fp32 opmath with one rounding instead of stock's separate bf16 roundings:
    ``close``, never ``exact`` (measured: see docs/results.md).
Fallbacks (stock's ops, counted with a reason: ``fallback_reasons()``)
    batch rows with different modulation (per-sample timesteps), the edit models' two-segment image norms
    (``zero_cond_t``: the modulation differs between segments; their text norms do take the fast path), MindIE-SD's
    fused AdaLayerNorm (already one kernel), a LayerNorm with its own affine weights or hooks, mixed dtypes.
Gates
    SSIM >= 0.999 and PSNR >= 45 dB against the configuration without it (``close_gates``; tests/test_fast_modulate.py
    and the ``tiny-cpu-fast`` ablation).
Upstream PR
    None yet. Proposal: ``AdaLayerNorm.forward_native`` / ``forward_npu`` pass ``1 + scale`` and ``shift`` as the
    layer norm's weight and bias when they are ``[B=1, 1, D]``.
Removal plan
    Drop when vLLM-Omni's AdaLayerNorm fuses the modulation into the norm kernel itself.
"""

from __future__ import annotations

from vllm_omni_ascend_opt.blocks.upstream import targets as _targets
from vllm_omni_ascend_opt.opts._fast_tier import FastBlockMode


class FastModulate(FastBlockMode):
    name = "fast_modulate"
    summary = (
        "AdaLayerNorm modulate as one affine layer_norm (weight 1+scale, bias shift): 2-4 fewer kernels per norm; "
        "a last-bit change (1 ulp bf16), gated by SSIM >= 0.999 / PSNR >= 45 dB."
    )
    mode = "modulate"
    #: What its one affine layer norm replaces: AdaLayerNorm's native and NPU paths (and the block it runs in).
    upstream = (_targets.BLOCK_FORWARD, _targets.ADA_FORWARD_NATIVE, _targets.ADA_FORWARD_NPU)
    removal_plan = "when vLLM-Omni's AdaLayerNorm fuses (1 + scale, shift) into its layer norm kernel"

    def notes(self) -> list[str]:
        return ["one kernel per AdaLayerNorm where the modulation is per sample; two-segment image norms keep stock's"]


OPT = FastModulate()
