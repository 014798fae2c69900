"""Upstream code and guards: source fingerprints (``fingerprints``, shared declarations in ``targets``), call-time
guards (``guards``), per-forward decisions (``forward_scope``), AdaLayerNorm dispatch (``ada_norm``) and vLLM-Omni's
layerwise offloader (``layerwise``)."""
