"""`fast_modulate`: each AdaLayerNorm's modulation as one affine layer norm (:class:`FastModulate`).

A mode of ``shared_modulation``'s block body (``_fast_tier``). The ``[D]`` weight and bias are views of the memoized
``(1 + scale, shift)``, kept with the memo entry. Stock's ops run, with a counted reason, for batch rows with
different modulation, two-segment image norms, MindIE-SD's fused AdaLayerNorm, a LayerNorm with its own affine or
hooks, and mixed dtypes.
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
    why = (
        "Each of a block's four AdaLayerNorms runs a layer norm without affine, then * (1 + scale) and + shift: 3 "
        "kernels per norm in fp32, 5 in bf16 on the native path (x.float(), layer norm, cast back, mul, add); "
        "batch-1 eager inference on an NPU is bound by kernel launches."
    )
    how = (
        "Where one [1, 1, D] row of modulation serves every token, F.layer_norm(x, (D,), weight=1 + scale, "
        "bias=shift, eps), on an NPU without MindIE-SD torch_npu.npu_layer_norm_eval (the kernel stock's "
        "forward_npu already calls): one kernel per norm. The affine runs in the kernel's fp32 opmath with one "
        "rounding instead of stock's separate roundings (1 ulp in bf16): close, gated at SSIM >= 0.999 and PSNR "
        ">= 45 dB against the configuration without it."
    )
    upstream_pr = (
        "vllm-omni #7419 (open) fuses Qwen-Image's residual and paired AdaLN pointwise stages on CUDA (Triton, "
        "opt-in, keeping the eager roundings); this is the NPU/native form as one affine layer norm, not "
        "bit-faithful. Proposal: AdaLayerNorm.forward_native / forward_npu pass 1 + scale and shift as the layer "
        "norm's weight and bias when they are [1, 1, D]."
    )
    removal_plan = "Drop when vLLM-Omni's AdaLayerNorm fuses (1 + scale, shift) into its layer norm kernel."
    slot = FAST_MODULATE
    #: AdaLayerNorm's native and NPU paths (and the block they run in).
    upstream = (_targets.BLOCK_FORWARD, _targets.ADA_FORWARD_NATIVE, _targets.ADA_FORWARD_NPU)

    def notes(self) -> list[str]:
        return ["one kernel per AdaLayerNorm where the modulation is per sample; two-segment image norms keep stock's"]


OPT = FastModulate()
