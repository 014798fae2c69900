"""The built-in optimizations, one module each; ``registry.BUILTIN`` lists them in registry order.

Optimizations never import each other: what they share lives in ``vllm_omni_ascend_opt.blocks``, and what one
needs from another goes through the registry (``Optimization.needs``, ``announce_weights_changed``).
"""
