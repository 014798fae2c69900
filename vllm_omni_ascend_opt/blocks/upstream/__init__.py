"""Upstream code: source fingerprints and shared declarations, call-time guards, per-forward decisions, AdaLayerNorm
dispatch and vLLM-Omni's layerwise offloader."""
