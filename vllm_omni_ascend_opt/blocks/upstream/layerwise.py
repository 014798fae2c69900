"""vLLM-Omni's layerwise offloader: block weights stay on the host, one flattened tensor per block and dtype; block
``i``'s ``pre_forward`` prefetches block ``i + 1``, its ``post_forward`` swaps its own for empty placeholders."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

LAYERWISE_MODULE = "vllm_omni.diffusion.offloader.layerwise_backend"
HOOK_NAME = "layerwise_offload"
MODULATION_PREFIXES = ("img_mod.", "txt_mod.")


def is_modulation(name: str) -> bool:
    """Whether the block weight ``name`` (offloader metadata, LoRA-wrapped too) is ``img_mod``'s / ``txt_mod``'s."""
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
