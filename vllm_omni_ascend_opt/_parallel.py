"""Which of vLLM-Omni's parallel modes a model (or this process) runs in, and what that means for an optimization.

Optimizations declare per mode in ``Optimization.parallel_support`` whether they are correct there ("supported") or
turn themselves off ("off: <reason>"). :meth:`Optimization.reasons_inactive` asks :func:`parallel_reasons_inactive`
for every model, so that ``list``, the loader hook and the tests all see the same reason.

Process-wide patches are installed when vLLM-Omni's modules are imported, before the parallel groups exist, so the
mode can only be known per model (its ``parallel_config``) or at call time (the current diffusion config).
"""

from __future__ import annotations

from typing import Any

#: DiffusionParallelConfig field -> mode name used in ``parallel_support``.
_FIELDS = (
    ("ulysses_degree", "ulysses"),
    ("ring_degree", "ring"),
    ("allgather_degree", "allgather"),
    ("cfg_parallel_size", "cfg_parallel"),
    ("tensor_parallel_size", "tensor_parallel"),
    ("vae_patch_parallel_size", "vae_patch_parallel"),
)


def _parallel_config(model: Any = None) -> Any:
    for obj in (model, getattr(model, "transformer", None)):
        pc = getattr(obj, "parallel_config", None)
        if pc is not None:
            return pc
        od = getattr(obj, "od_config", None)
        if od is not None and getattr(od, "parallel_config", None) is not None:
            return od.parallel_config
    try:
        from vllm_omni.diffusion.config import get_current_diffusion_config_or_none
    except ImportError:
        return None
    od = get_current_diffusion_config_or_none()
    return getattr(od, "parallel_config", None)


def active_modes(model: Any = None) -> list[str]:
    """The parallel modes ``model`` runs in (``["single"]`` when none), from its vLLM-Omni ``parallel_config``.

    ``model`` may be a pipeline, a transformer, or None (then the current diffusion config is used, which vLLM-Omni's
    worker sets around model construction and every forward). Modes that are not among the registry's
    ``PARALLEL_MODES`` (``allgather``, ``vae_patch_parallel``) are reported too, so that an optimization that has not
    declared them turns itself off there.
    """
    pc = _parallel_config(model)
    if pc is None:
        return ["single"]
    modes = [name for attr, name in _FIELDS if int(getattr(pc, attr, 1) or 1) > 1]
    return modes or ["single"]


def parallel_reasons_inactive(opt: Any, model: Any = None) -> list[str]:
    """Reasons ``opt`` must stay off for ``model``: one per active mode that its ``parallel_support`` does not
    declare "supported" (a mode it does not mention is not supported)."""
    support = dict(getattr(opt, "parallel_support", {}) or {})
    out = []
    for mode in active_modes(model):
        state = support.get(mode, "off: not declared for this mode")
        if state != "supported":
            why = state.split(":", 1)[1].strip() if state.startswith("off:") else state
            out.append(f"off under vLLM-Omni {mode} parallelism: {why}")
    return out
