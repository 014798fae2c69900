"""Shared building blocks of the optimizations, imported by them; nothing here knows the registry, and an optimization
imports only these blocks (and its ``opts/_*`` base), never another optimization. Layered top to bottom
(``lint-imports``): ``memo/`` (the modulation memo), ``body/`` (block body, joint QKV), ``kernels/`` (on-device
kernels and their verification), ``upstream/`` (upstream code and guards); ``weak_lru`` caches keyed on tensors."""
