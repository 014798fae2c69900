"""`vae_fast`: Faster approximate VAE decode, accepted only within SSIM >= 0.99 and PSNR >= 35 dB of stock."""

from __future__ import annotations

from vllm_omni_ascend_opt.opts import _targets
from vllm_omni_ascend_opt.registry import Optimization, register_optimization


class VaeFast(Optimization):
    name = "vae_fast"
    summary = "Faster approximate VAE decode, accepted only within SSIM >= 0.99 and PSNR >= 35 dB of stock."
    equivalence = "close"
    default_enabled = False
    requires = ("vLLM-Omni 0.30.x with diffusers 0.40.x; any device",)
    target_modules = (_targets.DIST_VAE,)

    def reasons_inactive(self) -> list[str]:
        return ["not implemented yet"]


OPT = register_optimization(VaeFast())
