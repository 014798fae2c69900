"""`shared_modulation`: Compute SiLU(temb) and the per-block modulation projections once per distinct timestep embedding (exact memo), and unpack them once per block into broadcast-ready tensors."""

from __future__ import annotations

from vllm_omni_ascend_opt.opts import _targets
from vllm_omni_ascend_opt.registry import Optimization, register_optimization


class SharedModulation(Optimization):
    name = "shared_modulation"
    summary = "Compute SiLU(temb) and the per-block modulation projections once per distinct timestep embedding (exact memo), and unpack them once per block into broadcast-ready tensors."
    equivalence = "exact"
    default_enabled = True
    requires = ("vLLM-Omni 0.30.x; any device and dtype",)
    target_modules = (_targets.TRANSFORMER,)

    def reasons_inactive(self) -> list[str]:
        return ["not implemented yet"]


OPT = register_optimization(SharedModulation())
