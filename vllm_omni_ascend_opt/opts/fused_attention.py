"""`fused_attention`: Run the joint text+image attention with torch_npu.npu_fusion_attention (BSND), verified against SDPA on first use."""

from __future__ import annotations

from vllm_omni_ascend_opt.opts import _targets
from vllm_omni_ascend_opt.registry import Optimization, register_optimization


class FusedAttention(Optimization):
    name = "fused_attention"
    summary = "Run the joint text+image attention with torch_npu.npu_fusion_attention (BSND), verified against SDPA on first use."
    equivalence = "close"
    default_enabled = True
    requires = ("torch_npu with npu_fusion_attention; an Ascend NPU; fp16/bf16",)
    target_modules = (_targets.TRANSFORMER,)

    def reasons_inactive(self) -> list[str]:
        return ["not implemented yet"]


OPT = register_optimization(FusedAttention())
