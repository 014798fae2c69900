"""`nz_weights`: Cast the transformer's BF16/FP16 linear weights to FRACTAL_NZ (npu_format_cast(w, 29)) after loading."""

from __future__ import annotations

from vllm_omni_ascend_opt.opts import _targets
from vllm_omni_ascend_opt.registry import Optimization, register_optimization


class NzWeights(Optimization):
    name = "nz_weights"
    summary = "Cast the transformer's BF16/FP16 linear weights to FRACTAL_NZ (npu_format_cast(w, 29)) after loading."
    equivalence = "close"
    default_enabled = True
    requires = ("torch_npu; weights on an NPU; fp16/bf16; torch.npu.config.allow_internal_format",)
    target_modules = (_targets.TRANSFORMER,)

    def reasons_inactive(self) -> list[str]:
        return ["not implemented yet"]


OPT = register_optimization(NzWeights())
