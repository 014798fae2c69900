"""Bytes vLLM-Omni's layerwise offloader copies host->device: every ``aten::copy_`` out of its host weight tensors
(prefetch, cache skips, late copies alike); on CPU, what an NPU would receive over PCIe."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_omni_ascend_opt.blocks.upstream.guards import find_transformers
from vllm_omni_ascend_opt.blocks.upstream.layerwise import host_weights


class OffloadCopies(TorchDispatchMode):
    """``bytes`` and ``copies`` out of the given host tensors while active."""

    def __init__(self, host: list[torch.Tensor]) -> None:
        super().__init__()
        self._storages = {t.untyped_storage().data_ptr() for t in host}
        self.bytes = 0
        self.copies = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.copy_.default and len(args) > 1:
            src = args[1]
            if isinstance(src, torch.Tensor) and src.untyped_storage().data_ptr() in self._storages:
                self.bytes += src.numel() * src.element_size()
                self.copies += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_offload_copies(model: Any) -> Iterator[OffloadCopies]:
    """The copies out of ``model``'s layerwise offloaded host weights while active (raises when there are none)."""
    host = [t for tr in find_transformers(model) for t in host_weights(tr)]
    if not host:
        raise RuntimeError("no transformer block of this model is offloaded layerwise (enable_layerwise_offload)")
    with OffloadCopies(host) as counter:
        yield counter
