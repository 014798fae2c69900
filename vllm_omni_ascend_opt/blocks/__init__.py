"""Shared building blocks of the optimizations: written once, imported by the optimizations that use them.

Nothing here is an optimization or knows about the registry; an optimization never imports another optimization,
only these blocks (and, for families, its ``opts/_*`` base). Four sub-packages, one concern each, layered top to
bottom (``lint-imports`` checks it; each package's docstring says what belongs there): ``memo/`` (the modulation
memo), ``body/`` (the patched block body and the joint QKV path), ``kernels/`` (on-device kernels and their
verification), ``upstream/`` (upstream code and guards). ``weak_lru`` is the one helper for caches keyed on tensors
by identity (entries die with their tensors).
"""
