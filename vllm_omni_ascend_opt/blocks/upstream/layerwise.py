"""vLLM-Omni's layerwise offloader (``diffusion/offloader/layerwise_backend.py``) as the plugin and the test bed see
it, for ``memo_aware_offload`` (which weights to leave on the host) and ``testbed/offload.py`` (bytes copied).

``enable_layerwise_offload`` keeps every block's weights on the host, flattened per dtype into one tensor per block
(``LayerwiseOffloadHook.dtype_cpu_flattened_weights``, per-weight ``dtype_metadata``: name, offset, numel, shape,
stride), and hooks a ring over the blocks: block ``i``'s ``pre_forward`` copies block ``i + 1``'s weights
host->device (``prefetch_layer``; the last block prefetches block 0 for the next forward), its ``post_forward`` swaps
its own weights for zero-element placeholders (``offload_layer``).
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

#: vLLM-Omni's layerwise offload module and the name its hooks are registered under.
LAYERWISE_MODULE = "vllm_omni.diffusion.offloader.layerwise_backend"
HOOK_NAME = "layerwise_offload"
#: Weight-name prefixes (in a block) of the modulation projections ``img_mod`` / ``txt_mod`` (a LoRA wrapper keeps
#: the same parameter objects under these names in the offloader's metadata).
MODULATION_PREFIXES = ("img_mod.", "txt_mod.")


def is_modulation(name: str) -> bool:
    """Whether the block weight ``name`` (as in the offloader's metadata) belongs to ``img_mod`` / ``txt_mod``."""
    return name.startswith(MODULATION_PREFIXES)


def block_hook(block: nn.Module) -> Any | None:
    """The layerwise offload hook registered on ``block`` (None: the block is not offloaded layerwise)."""
    registry = getattr(block, "_hook_registry", None)
    get = getattr(registry, "get_hook", None)
    return get(HOOK_NAME) if callable(get) else None


def layerwise_hooks(transformer: nn.Module) -> list[Any]:
    """The hook of each of ``transformer``'s blocks (empty when none is offloaded layerwise)."""
    hooks = [block_hook(b) for b in getattr(transformer, "transformer_blocks", ())]
    return hooks if any(h is not None for h in hooks) else []


def host_weights(transformer: nn.Module) -> list[Any]:
    """The host tensors the offloader streams ``transformer``'s blocks from (one per block and dtype)."""
    return [t for h in layerwise_hooks(transformer) if h is not None for t in h.dtype_cpu_flattened_weights.values()]
