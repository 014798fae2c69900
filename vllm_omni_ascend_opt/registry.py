"""The registry: every optimization, in its fixed order (of ``list``, the flag, cumulative ablations and the docs).

Optimizations never import each other: each receives the registry as its ``Peers``, to ``get`` the optimizations it
``needs`` and to announce ``weights_changed``, which every other optimization hears.
"""

from __future__ import annotations

from typing import Any

from vllm_omni_ascend_opt.optimization import Optimization
from vllm_omni_ascend_opt.opts import (
    fast_modulate,
    fast_residual,
    fused_attention,
    joint_attention,
    memo_aware_offload,
    nz_weights,
    qk_norm,
    rope,
    shared_modulation,
    vae_exact,
    vae_fast,
)

BUILTIN: tuple[Optimization, ...] = (
    shared_modulation.OPT,
    rope.OPT,
    fused_attention.OPT,
    nz_weights.OPT,
    vae_exact.OPT,
    vae_fast.OPT,
    joint_attention.OPT,
    qk_norm.OPT,
    fast_modulate.OPT,
    fast_residual.OPT,
    memo_aware_offload.OPT,
)


class Registry:
    """Optimizations by name, in registration order; the :class:`Peers` every member asks."""

    def __init__(self, opts: tuple[Optimization, ...] = ()) -> None:
        self._opts: dict[str, Optimization] = {}
        for opt in opts:
            self.add(opt)

    def add(self, opt: Optimization) -> Optimization:
        if opt.name in self._opts and self._opts[opt.name] is not opt:
            raise ValueError(f"optimization {opt.name!r} is registered twice")
        self._opts[opt.name] = opt
        opt.bind_peers(self)
        return opt

    def remove(self, name: str) -> None:
        self._opts.pop(name, None)

    def all(self) -> list[Optimization]:
        return list(self._opts.values())

    def names(self) -> list[str]:
        return list(self._opts)

    def get(self, name: str) -> Optimization:
        try:
            return self._opts[name]
        except KeyError:
            raise KeyError(f"unknown optimization {name!r}; valid names: {', '.join(self._opts)}") from None

    def weights_changed(self, model: Any = None, *, source: Optimization | None = None) -> None:
        """Every optimization but ``source`` hears that weights of ``model`` (None: any model) changed."""
        for opt in self._opts.values():
            if opt is not source:
                opt.weights_changed(model)


REGISTRY = Registry(BUILTIN)
#: The one registry's methods; ``register_optimization`` adds after the built-in ones (the order of ``list``).
register_optimization, all_optimizations, names, get = REGISTRY.add, REGISTRY.all, REGISTRY.names, REGISTRY.get


def patching(module: str, names: list[str] | tuple[str, ...] | None = None) -> list[str]:
    """The optimizations that patch ``module`` (in registry order; only those in ``names`` when given)."""
    return [o.name for o in REGISTRY.all() if module in o.target_modules and (names is None or o.name in names)]


def in_region(region: str) -> list[str]:
    """The optimizations whose patched code runs in ``region`` (``Optimization.regions``), in registry order."""
    return [o.name for o in REGISTRY.all() if region in o.regions]


def default_names() -> list[str]:
    return [o.name for o in REGISTRY.all() if o.default_enabled]
