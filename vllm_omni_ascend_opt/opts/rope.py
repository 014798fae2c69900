"""`rope`: Build RoPE cos/sin tables once per forward shape and reuse them in every block; on Ascend apply them with a verified torch_npu.npu_rotary_mul (interleave)."""

from __future__ import annotations

from vllm_omni_ascend_opt.opts import _targets
from vllm_omni_ascend_opt.registry import Optimization, register_optimization


class Rope(Optimization):
    name = "rope"
    summary = "Build RoPE cos/sin tables once per forward shape and reuse them in every block; on Ascend apply them with a verified torch_npu.npu_rotary_mul (interleave)."
    equivalence = "exact"
    default_enabled = True
    requires = ("vLLM-Omni 0.30.x; NPU kernel path: torch_npu with npu_rotary_mul rotary_mode='interleave'",)
    target_modules = (_targets.TRANSFORMER,)

    def reasons_inactive(self) -> list[str]:
        return ["not implemented yet"]


OPT = register_optimization(Rope())
