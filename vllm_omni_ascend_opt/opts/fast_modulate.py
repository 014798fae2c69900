"""`fast_modulate`: each AdaLayerNorm's modulation as one affine layer norm (:class:`FastModulate`).

A mode of ``shared_modulation``'s block body (``_fast_tier``); the ``[D]`` weight and bias are views of the memoized
``(1 + scale, shift)``.
"""

from __future__ import annotations

from vllm_omni_ascend_opt.blocks.body.block_body import FAST_MODULATE
from vllm_omni_ascend_opt.blocks.upstream import targets as _targets
from vllm_omni_ascend_opt.opts._fast_tier import FastBlockMode


class FastModulate(FastBlockMode):
    name = "fast_modulate"
    summary = (
        "AdaLayerNorm modulate as one affine layer_norm (weight 1+scale, bias shift): 2-4 fewer kernels per norm; "
        "a last-bit change (1 ulp bf16), gated by SSIM >= 0.999 / PSNR >= 45 dB."
    )
    why = "Each AdaLayerNorm runs a plain layer norm, then * (1 + scale) and + shift: 3 to 5 kernels per norm."
    how = (
        "Where one [1, 1, D] modulation row serves every token, F.layer_norm(x, (D,), weight=1 + scale, "
        "bias=shift, eps) (npu_layer_norm_eval on an NPU without MindIE-SD, as stock's forward_npu): one kernel "
        "per norm, its affine in fp32 with one rounding (1 ulp in bf16): close, gated at SSIM >= 0.999 and PSNR "
        ">= 45 dB against the configuration without it."
    )
    upstream_pr = (
        "vllm-omni #7419 (open) fuses Qwen-Image's residual and AdaLN pointwise stages on CUDA (Triton, opt-in, "
        "eager roundings kept); this is the NPU/native form, not bit-faithful. Proposal: AdaLayerNorm passes 1 + "
        "scale and shift as the layer norm's weight and bias when they are [1, 1, D]."
    )
    removal_plan = "Drop when vLLM-Omni's AdaLayerNorm fuses (1 + scale, shift) into its layer norm kernel."
    slot = FAST_MODULATE
    upstream = (_targets.BLOCK_FORWARD, _targets.ADA_FORWARD_NATIVE, _targets.ADA_FORWARD_NPU)

    def notes(self) -> list[str]:
        return ["one kernel per AdaLayerNorm where the modulation is per sample; two-segment image norms keep stock's"]


OPT = FastModulate()
