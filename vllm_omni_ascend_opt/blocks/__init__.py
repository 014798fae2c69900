"""Shared building blocks of the optimizations: written once, imported by the optimizations that use them.

Nothing here is an optimization or knows about the registry; an optimization never imports another optimization,
only these blocks (and, for families, its ``opts/_*`` base). Four sub-packages, one concern each, layered top to
bottom (``lint-imports`` checks it):

* ``memo/``: the modulation memo (its cache, what it keys on, the time-embedding key). A new memo key goes here.
* ``body/``: the patched block body and the joint QKV path, eager and as written for compiled graphs, and what
  regional compile hoists into them. A new way to run part of a block goes here.
* ``kernels/``: on-device kernel verification (verdicts, the NPU rotary, RMSNorm and attention kernels) and the
  RoPE tables and portable rotary math they are checked against. A new kernel goes here, with its checks.
* ``upstream/``: upstream code and guards: the fingerprint declarations (``fingerprints``, shared ones in
  ``targets``), call-time guards, per-forward decisions (``forward_scope``), AdaLayerNorm's dispatch kinds,
  the layerwise offloader as seen. A new fingerprint or a new check of upstream state goes here.

``weak_lru`` is the one helper for caches keyed on tensors by identity (entries die with their tensors).
"""
