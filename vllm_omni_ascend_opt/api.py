"""Python API: one switch per optimization, on the process or on an already-built model::

    from vllm_omni_ascend_opt import apply_to_qwen_image, optimizations
    apply_to_qwen_image(pipeline, nz_weights=False)               # the default stack minus nz_weights, on it
    with optimizations("none,+rope", model=pipeline):              # temporarily a different selection
        ...

The keywords of :func:`apply_to_qwen_image` are the registry's names, each defaulting to ``default_enabled``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

from vllm_omni_ascend_opt import _plugin, _report, flags, registry
from vllm_omni_ascend_opt._state import STATE

#: ``installed()``: the names installed now; ``status(model=None)``: one row per optimization (what ``list`` prints).
installed = _report.installed
status = _report.rows


def _names(spec: str | Iterable[str]) -> list[str]:
    if isinstance(spec, str):
        return flags.parse_spec(spec)
    return [registry.get(n).name for n in spec]  # registry.get raises KeyError listing valid names


def select(spec: str | Iterable[str], model: Any = None) -> list[str]:
    """Make exactly ``spec`` selected process-wide; attach/detach ``model`` accordingly. Returns what is installed."""
    _plugin.set_selected(_names(spec))
    if model is not None:
        for opt in registry.all_optimizations():
            (opt.attach if opt.installed else opt.detach)(model)
    return installed()


def enable(*names: str, model: Any = None) -> list[str]:
    """Add ``names`` to the selection (installing them) and attach them to ``model`` if given."""
    return select(set(STATE.selected) | set(_names(names)), model)


def disable(*names: str, model: Any = None) -> list[str]:
    """Remove ``names`` from the selection; their patches are reverted and ``model`` restored."""
    return select(set(STATE.selected) - set(_names(names)), model)


@contextlib.contextmanager
def optimizations(spec: str | Iterable[str], model: Any = None) -> Iterator[list[str]]:
    """Within the block exactly ``spec`` is selected (and applied to ``model``); the previous selection returns."""
    before = list(STATE.selected)
    try:
        yield select(spec, model)
    finally:
        select(before, model)


def accepted_keywords() -> dict[str, bool]:
    """The keywords :func:`apply_to_qwen_image` accepts (every registered optimization) and their defaults."""
    return {o.name: o.default_enabled for o in registry.all_optimizations()}


def apply_to_qwen_image(model: Any = None, **switches: bool) -> list[str]:
    """Select the default stack with one keyword per optimization overriding it (``rope=False``, ``vae_fast=True``);
    ``model`` may be a built pipeline or transformer. Returns what is installed."""
    chosen = accepted_keywords()
    if unknown := sorted(set(switches) - set(chosen)):
        raise TypeError(
            f"apply_to_qwen_image() got unknown optimization keyword(s) {', '.join(unknown)}; "
            f"accepted: {', '.join(chosen)}"
        )
    chosen.update({k: bool(v) for k, v in switches.items()})
    return select([n for n, on in chosen.items() if on], model)
