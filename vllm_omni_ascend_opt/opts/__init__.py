"""The built-in optimizations, registered in registry order (the order of ``list`` and cumulative ablations)."""

# isort: skip_file
# ruff: noqa: F401

from vllm_omni_ascend_opt.opts import shared_modulation, rope, fused_attention, nz_weights, vae_exact, vae_fast
from vllm_omni_ascend_opt.opts import joint_attention, qk_norm, fast_modulate, fast_residual
