"""Work hoisted out of regionally compiled blocks (the memo's lookup, this forward's RoPE tables), which dynamo would
bake into a block's graph: a :class:`Hoister`'s pre-hook runs in eager (vLLM-Omni compiles ``forward``, not
``__call__``) and leaves its result on the module (:func:`set_ready`) for the traced code to read (:func:`ready`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch.nn as nn

from vllm_omni_ascend_opt.blocks.upstream import guards

Hook = Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]


def set_ready(module: nn.Module, name: str, value: Any) -> None:
    """Leave ``value`` (None, or tuples of tensors and constants) on ``module`` for its compiled code to read."""
    module.__dict__[name] = value


def ready(module: nn.Module, name: str) -> Any:
    """What the eager hook left on ``module`` under ``name`` (None when nothing was hoisted). Traceable."""
    return module.__dict__.get(name)


class Hoister:
    """Pre-hooks ``hook(block, args, kwargs)`` on every block of a transformer once its blocks are compiled."""

    def __init__(self, hook: Hook, names: tuple[str, ...], submodule: str | None = None) -> None:
        self._hook = hook
        self._names = names  # what the hook sets (cleared on release), on the block or ``block.<submodule>``
        self._submodule = submodule
        self._handles: weakref.WeakKeyDictionary[nn.Module, list[Any]] = weakref.WeakKeyDictionary()

    def _pre(self, block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not guards.tracing():  # full compile traces these hooks: nothing to do
            self._hook(block, args, kwargs)

    def on_forward(self, transformer: nn.Module) -> None:
        """A forward of ``transformer`` starts (eager): register the hooks once its blocks are compiled."""
        if transformer in self._handles:
            return
        blocks = transformer._modules.get("transformer_blocks")
        first = next(iter(blocks._modules.values()), None) if blocks is not None else None
        if first is None or not guards.block_compiled(first):
            return
        self._handles[transformer] = [b.register_forward_pre_hook(self._pre, with_kwargs=True) for b in blocks]

    def release(self, transformer: nn.Module) -> None:
        """Remove the hooks and what they left on the modules."""
        for h in self._handles.pop(transformer, ()):
            h.remove()
        for block in getattr(transformer, "transformer_blocks", ()):
            target = block._modules.get(self._submodule) if self._submodule else block
            if target is not None:
                for name in self._names:
                    target.__dict__.pop(name, None)

    def release_all(self) -> None:
        for transformer in list(self._handles):
            self.release(transformer)
