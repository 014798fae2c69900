"""The built-in optimizations, registered in registry order (the order of ``list`` and cumulative ablations)."""

# isort: skip_file

from vllm_omni_ascend_opt.opts import shared_modulation, rope, fused_attention, nz_weights, vae_exact, vae_fast, joint_attention, qk_norm  # noqa: F401
from vllm_omni_ascend_opt.opts import fast_modulate, fast_residual  # noqa: F401
