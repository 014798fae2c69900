"""`vae_exact`: Remove VAE decode work that never changes a bit for single-frame images (unread cache clones, fp32 round trips, repeated counts)."""

from __future__ import annotations

from vllm_omni_ascend_opt.opts import _targets
from vllm_omni_ascend_opt.registry import Optimization, register_optimization


class VaeExact(Optimization):
    name = "vae_exact"
    summary = "Remove VAE decode work that never changes a bit for single-frame images (unread cache clones, fp32 round trips, repeated counts)."
    equivalence = "exact"
    default_enabled = True
    requires = ("vLLM-Omni 0.30.x with diffusers 0.40.x; any device",)
    target_modules = (_targets.DIST_VAE,)

    def reasons_inactive(self) -> list[str]:
        return ["not implemented yet"]


OPT = register_optimization(VaeExact())
