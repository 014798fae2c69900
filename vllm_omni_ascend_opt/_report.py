"""What the plugin tells the process it runs in: the status rows, one INFO line in vLLM's log, a JSON status file.

Every report derives from :func:`explain`: the plugin state (:mod:`._state`) and each optimization's
``reasons_inactive``. :func:`announce` logs the line once the selection is settled, through vLLM's handlers
(:func:`wire_into_vllm_logging`). ``VLLM_OMNI_ASCEND_OPT_STATUS_FILE`` (``{pid}``: the process id) names a JSON file
written atomically after the model is built and after each of its forwards (tests and the ablation runner read it).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_omni_ascend_opt import flags, registry
from vllm_omni_ascend_opt._state import STATE
from vllm_omni_ascend_opt._version import __version__
from vllm_omni_ascend_opt.blocks.upstream import guards
from vllm_omni_ascend_opt.optimization import Optimization

ENV_STATUS_FILE = "VLLM_OMNI_ASCEND_OPT_STATUS_FILE"
LOGGER_NAME = "vllm_omni_ascend_opt"
#: The reason shown for a selected optimization that can act but whose vLLM-Omni modules are not imported yet.
WAITING = "waits for its vLLM-Omni modules to be imported"

#: vLLM-Omni cache backends that refuse Qwen-Image upstream (``diffusion/cache/selector.py``).
UPSTREAM_UNSUPPORTED_CACHE_BACKENDS: dict[str, str] = {
    "sea_cache": "vLLM-Omni's SeaCache supports Cosmos3 only: loading QwenImagePipeline raises ValueError",
    "step_cache": "vLLM-Omni's step_cache supports DreamZero only: loading QwenImagePipeline raises ValueError",
}

logger = logging.getLogger(LOGGER_NAME)
_write_lock = threading.Lock()
#: What this process reported: "announced", "requests" (forwards), the tracked "model", the status file's "failures".
_seen: dict[str, Any] = {}


def wire_into_vllm_logging() -> None:
    """Give the plugin's logger vLLM's handlers and level, when vLLM has handlers (idempotent)."""
    vllm_logger = logging.getLogger("vllm")
    for handler in vllm_logger.handlers:
        if handler not in logger.handlers:
            logger.addHandler(handler)
    if vllm_logger.handlers and logger.level == logging.NOTSET:
        logger.setLevel(vllm_logger.level)


# ----- the one derivation
def explain(opt: Optimization, model: Any = None) -> list[str]:
    """Why ``opt`` does not act (empty: it does): the plugin's reasons, then the optimization's own."""
    return list(dict.fromkeys(STATE.reasons(opt.name) + opt.reasons_inactive(model)))


def mode_notes() -> list[str]:
    """Facts about vLLM-Omni's modes that hold whatever the plugin does (``list`` prints them)."""
    return [
        f"cache_backend={name!r} does not support Qwen-Image upstream: {why}"
        for name, why in UPSTREAM_UNSUPPORTED_CACHE_BACKENDS.items()
    ]


def installed() -> list[str]:
    """Names whose patches are installed in this process right now."""
    return [o.name for o in registry.all_optimizations() if o.installed]


def acting(model: Any) -> list[str]:
    """Names that act on ``model`` (selected, installed, attached, and no reason on that model)."""
    return [o.name for o in registry.all_optimizations() if not explain(o, model)]


def rows(model: Any = None) -> list[dict[str, Any]]:
    """One row per optimization (what ``list`` prints): metadata and state in this process, or on ``model``."""
    return [
        {
            "name": opt.name,
            **{k: getattr(opt, k) for k in ("summary", "why", "how", "upstream_pr", "removal_plan", "equivalence")},
            "tier": opt.tier(),
            "default": opt.default_enabled,
            "selected": opt.name in STATE.selected,
            "active": not (reasons := explain(opt, model)),
            "installed": opt.installed,
            "reasons_inactive": reasons,
            "notes": [*opt.upstream_notes(), *opt.notes()],
            "kernel_classes": opt.kernel_classes() if opt.installed else None,
            "upstream": [f.as_dict() for f in opt.upstream_findings()],
            "requires": list(opt.requires),
            "parallel_support": dict(opt.parallel_support),
            "flag": {"enable": f"+{opt.name}", "disable": f"-{opt.name}"},
        }
        for opt in registry.all_optimizations()
    ]


def off_reasons(model: Any = None) -> dict[str, list[str]]:
    """Every optimization not installed (without ``model``) or not acting on ``model`` -> its reasons."""
    opts = registry.all_optimizations()
    if model is not None:
        return {o.name: why for o in opts if (why := explain(o, model))}
    return {o.name: explain(o) or [WAITING] for o in opts if not o.installed}


def pending() -> list[str]:
    """Selected optimizations that can be active but are not installed yet (their modules are not imported)."""
    if STATE.blocked():
        return []
    return [n for n in STATE.selected if not (o := registry.get(n)).installed and not o.reasons_inactive()]


def status_line() -> str:
    off = "; ".join(f"{n} ({why[0]})" for n, why in off_reasons().items()) or "nothing"
    spec = os.environ.get(flags.ENV_FLAG)
    return (
        f"vllm-omni-ascend-opt {__version__} ({flags.ENV_FLAG}={spec if spec is not None else '<unset: default>'}): "
        f"installed {', '.join(installed()) or 'nothing'}; off: {off}"
    )


def announce(force: bool = False) -> None:
    """Log the status line once per process. Without ``force`` only when the selection is settled."""
    if _seen.get("announced") or (not force and pending()):
        return
    _seen["announced"] = True
    logger.info("%s", status_line())


# ----- status file
def status_file_path() -> Path | None:
    raw = os.environ.get(ENV_STATUS_FILE)
    return Path(raw.replace("{pid}", str(os.getpid()))) if raw else None


def _each(get: Callable[[Optimization], Any]) -> dict[str, Any]:
    return {o.name: v for o in registry.all_optimizations() if (v := get(o)) is not None}


def saved_verdicts() -> dict[str, Any] | None:
    """The verdict file and how many verdicts it holds (None: no torch_npu, or the cache is off)."""
    from vllm_omni_ascend_opt.blocks.kernels import saved

    p = saved.path()
    return None if p is None else {"path": str(p), "entries": saved.entries()}


def status_report(model: Any = None) -> dict[str, Any]:
    off = off_reasons(model)
    report: dict[str, Any] = {
        "pid": os.getpid(),
        "version": __version__,
        "flag": os.environ.get(flags.ENV_FLAG),
        **{k: getattr(STATE, k) for k in ("registered", "config_error", "version_error", "version_note")},
        "vllm_omni": STATE.omni_version,
        "selected": list(STATE.selected),
        "installed": installed(),
        "off": {n: why[0] for n, why in off.items()},
        "reasons": off,
        "memory": _each(lambda o: o.cache_memory()),
        "requests": _seen.get("requests", 0),
        "fallbacks": _each(lambda o: o.fallback_reasons() or None),
        "stats": _each(lambda o: dict(o.stats) if o.installed and o.stats else None),
        "kernels": _each(lambda o: o.kernel_classes() if o.installed else None),
        "saved_verdicts": saved_verdicts(),
    }
    if model is not None:
        report["pipeline"] = type(model).__name__
        report["acting_on_pipeline"] = acting(model)
        report["compiled_regions"] = sorted(guards.compiled_regions(model))
    return report


def write_status_file(model: Any = None) -> Path | None:
    """Write the report to ``$VLLM_OMNI_ASCEND_OPT_STATUS_FILE`` (atomically); None when the variable is unset."""
    if (path := status_file_path()) is None:
        return None
    with _write_lock:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        report = status_report(model if model is not None else _seen.get("model"))
        tmp.write_text(json.dumps(report, indent=1, sort_keys=True, default=str))
        os.replace(tmp, path)
    return path


#: Seconds between reminders that the status file cannot be written.
STATUS_REMINDER_S = 600.0


def write_status_file_safely(model: Any = None) -> None:
    """:func:`write_status_file`, never raising: one warning, then a reminder every :data:`STATUS_REMINDER_S`."""
    try:
        write_status_file(model)
    except Exception as exc:
        n = _seen["failures"] = _seen.get("failures", 0) + 1
        now = time.monotonic()
        if n == 1 or now - _seen.get("last_warning", now) >= STATUS_REMINDER_S:
            _seen["last_warning"] = now
            logger.warning(
                "vllm-omni-ascend-opt: cannot write the status file %s (%s: %s); %s",
                status_file_path(),
                exc.__class__.__name__,
                exc,
                "the engine runs on" if n == 1 else f"{n} writes failed so far",
            )
        return
    if _seen.pop("failures", 0):
        _seen.pop("last_warning", None)
        logger.info("vllm-omni-ascend-opt: the status file is written again: %s", status_file_path())


def track_model(model: Any) -> None:
    """Write the status file now and after each ``forward`` of ``model`` (only when the variable is set)."""
    if status_file_path() is None:
        return
    _seen["model"] = model
    forward = getattr(model, "forward", None)
    if forward is not None and not getattr(forward, "_ascend_opt_status", False):

        @functools.wraps(forward)
        def forward_then_report(*args: Any, **kwargs: Any) -> Any:
            out = forward(*args, **kwargs)
            _seen["requests"] = _seen.get("requests", 0) + 1
            write_status_file_safely(model)
            return out

        forward_then_report._ascend_opt_status = True  # type: ignore[attr-defined]
        model.forward = forward_then_report
    write_status_file_safely(model)
