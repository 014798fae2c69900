"""Python API: one switch per optimization, on the process or on an already-built model.

In the style of Liger-Kernel's ``apply_liger_kernel_to_*``::

    from vllm_omni_ascend_opt import apply_to_qwen_image, optimizations
    apply_to_qwen_image(pipeline, nz_weights=False)               # the default stack minus nz_weights, on it
    with optimizations("none,+rope", model=pipeline):              # temporarily a different selection
        ...
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

from vllm_omni_ascend_opt import _plugin, flags, registry


def _names(spec: str | Iterable[str]) -> list[str]:
    if isinstance(spec, str):
        return flags.parse_spec(spec)
    names = list(spec)
    for n in names:
        registry.get(n)  # raises KeyError listing valid names
    return names


def select(spec: str | Iterable[str], model: Any = None) -> list[str]:
    """Make exactly ``spec`` selected process-wide; attach/detach ``model`` accordingly. Returns what is installed."""
    names = _names(spec)
    _plugin.set_selected(names)
    if model is not None:
        for opt in registry.all_optimizations():
            if opt.installed:
                opt.attach(model)
            else:
                opt.detach(model)
    return installed()


def enable(*names: str, model: Any = None) -> list[str]:
    """Add ``names`` to the selection (installing them) and attach them to ``model`` if given."""
    return select(set(_plugin.selected()) | set(_names(names)), model)


def disable(*names: str, model: Any = None) -> list[str]:
    """Remove ``names`` from the selection; their patches are reverted and ``model`` restored."""
    return select(set(_plugin.selected()) - set(_names(names)), model)


@contextlib.contextmanager
def optimizations(spec: str | Iterable[str], model: Any = None) -> Iterator[list[str]]:
    """Within the block exactly ``spec`` is selected (and applied to ``model``); the previous selection returns."""
    before = _plugin.selected()
    try:
        yield select(spec, model)
    finally:
        select(before, model)


def apply_to_qwen_image(
    model: Any = None,
    *,
    shared_modulation: bool = True,
    rope: bool = True,
    fused_attention: bool = True,
    nz_weights: bool = True,
    vae_exact: bool = True,
    vae_fast: bool = False,
) -> list[str]:
    """One keyword per optimization (the defaults are the default stack): exactly the ``True`` ones are selected.
    ``model`` may be an already-built pipeline or transformer."""
    chosen = {
        "shared_modulation": shared_modulation,
        "rope": rope,
        "fused_attention": fused_attention,
        "nz_weights": nz_weights,
        "vae_exact": vae_exact,
        "vae_fast": vae_fast,
    }
    return select([n for n, on in chosen.items() if on], model)


def installed() -> list[str]:
    """Names whose patches are installed in this process right now."""
    return [o.name for o in registry.all_optimizations() if o.installed]


def status() -> list[dict[str, Any]]:
    """One row per optimization: metadata, selection and state here (what ``list`` prints)."""
    sel = set(_plugin.selected())
    rows = []
    for opt in registry.all_optimizations():
        reasons = list(opt.reasons_inactive())
        if _plugin.version_error() and not flags.force_from_env():
            reasons.insert(0, _plugin.version_error())
        if _plugin.config_error():
            reasons.insert(0, f"{flags.ENV_FLAG} is invalid, so nothing is patched")
        elif opt.name not in sel:
            reasons.insert(0, f"not selected by {flags.ENV_FLAG}")
        rows.append(
            {
                "name": opt.name,
                "summary": opt.summary,
                "equivalence": opt.equivalence,
                "tier": opt.tier(),
                "default": opt.default_enabled,
                "selected": opt.name in sel,
                "active": not reasons,
                "installed": opt.installed,
                "reasons_inactive": reasons,
                "notes": list(opt.notes()),
                "requires": list(opt.requires),
                "parallel_support": dict(opt.parallel_support),
                "flag": {"enable": f"+{opt.name}", "disable": f"-{opt.name}"},
            }
        )
    return rows
