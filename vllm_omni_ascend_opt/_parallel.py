"""Which of vLLM-Omni's parallel modes a model (or this process) runs in, against each ``parallel_support``. Patches
are installed before the parallel groups exist, so the mode is known only per model or at call time.
"""

from __future__ import annotations

from typing import Any

#: DiffusionParallelConfig fields; each names its mode in ``parallel_support`` (less ``_degree`` / ``_size``).
_FIELDS = "ulysses_degree ring_degree allgather_degree cfg_parallel_size tensor_parallel_size vae_patch_parallel_size"


def _parallel_config(model: Any = None) -> Any:
    for obj in (model, getattr(model, "transformer", None)):
        od = getattr(obj, "od_config", None)
        for pc in (getattr(obj, "parallel_config", None), getattr(od, "parallel_config", None)):
            if pc is not None:
                return pc
    try:
        from vllm_omni.diffusion.config import get_current_diffusion_config_or_none
    except ImportError:
        return None
    return getattr(get_current_diffusion_config_or_none(), "parallel_config", None)


def active_modes(model: Any = None) -> list[str]:
    """The parallel modes ``model`` (None: the current diffusion config) runs in, ``["single"]`` when none."""
    pc = _parallel_config(model)  # None: every degree reads as 1
    modes = [attr.rsplit("_", 1)[0] for attr in _FIELDS.split() if int(getattr(pc, attr, 1) or 1) > 1]
    return modes or ["single"]


def parallel_reasons_inactive(opt: Any, model: Any = None) -> list[str]:
    """One reason per active mode that ``opt``'s ``parallel_support`` does not declare "supported"."""
    support = dict(getattr(opt, "parallel_support", {}) or {})
    whys = ((mode, why_off(support.get(mode, "off: not declared for this mode"))) for mode in active_modes(model))
    return [f"off under vLLM-Omni {mode} parallelism: {why}" for mode, why in whys if why is not None]


def why_off(state: str) -> str | None:
    """The reason in a ``parallel_support`` value ("off: <reason>"); None for "supported"."""
    return None if state == "supported" else state.removeprefix("off:").strip()
