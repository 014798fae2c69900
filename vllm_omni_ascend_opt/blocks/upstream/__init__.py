"""Upstream code and guards: which upstream functions each optimization relies on, recognised by source
fingerprint (``fingerprints``; shared declarations in ``targets``), the call-time guards (``guards``), decisions made
once per transformer forward (``forward_scope``), how AdaLayerNorm instances dispatch (``ada_norm``) and vLLM-Omni's
layerwise offloader as the plugin sees it (``layerwise``). A new fingerprint or check of upstream state goes here."""
