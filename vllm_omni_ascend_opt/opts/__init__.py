"""The built-in optimizations, registered in registry order (the order of ``list`` and cumulative ablations)."""

from vllm_omni_ascend_opt.opts import (  # noqa: F401  (import order = registry order)
    shared_modulation,
    rope,
    fused_attention,
    nz_weights,
    vae_exact,
    vae_fast,
)
