"""What the plugin tells the process it runs in: one status line in vLLM's log, and an optional JSON status file.

* Log line. vLLM-Omni's logging setup configures only the ``vllm`` / ``vllm_omni`` logger trees, so the plugin's
  own ``vllm_omni_ascend_opt`` logger would print nothing in ``vllm serve --omni``. :func:`wire_into_vllm_logging`
  (called by ``register()``, i.e. only inside vLLM-Omni's processes) hands that logger vLLM's configured handlers
  and level: its records then appear in vLLM's format, on vLLM's stream, and still propagate (pytest's ``caplog``
  sees them). With ``VLLM_CONFIGURE_LOGGING=0`` vLLM has no handlers and nothing is wired.
  :func:`announce` logs ONE INFO line per process, once the selection is settled (every selected optimization that
  can be active is installed): version, flag, what is installed, and what is off with its first reason. A bad flag
  or an unsupported version is logged by ``register()`` as an ERROR / WARNING instead.
* Status file. When ``VLLM_OMNI_ASCEND_OPT_STATUS_FILE`` names a path, the process that builds a model with
  vLLM-Omni's loader writes a JSON report there (atomically) after the model is built and again after every
  ``forward`` of that model: pid, selected, installed, acting on the pipeline, off reasons, and the memory of the
  plugin's caches against their budgets. Tests and the ablation runner read it instead of scraping logs. ``{pid}``
  in the path is replaced by the process id.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

ENV_STATUS_FILE = "VLLM_OMNI_ASCEND_OPT_STATUS_FILE"
LOGGER_NAME = "vllm_omni_ascend_opt"

logger = logging.getLogger(LOGGER_NAME)
_announced = False
_write_lock = threading.Lock()


def wire_into_vllm_logging() -> bool:
    """Give the plugin's logger vLLM's handlers and level (idempotent). Returns True when they are wired."""
    vllm_logger = logging.getLogger("vllm")
    if not vllm_logger.handlers:
        return False
    for handler in vllm_logger.handlers:
        if handler not in logger.handlers:
            logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(vllm_logger.level)
    return True


def _version() -> str:
    from vllm_omni_ascend_opt import __version__

    return __version__


def off_reasons() -> dict[str, str]:
    """Every optimization that is not installed here -> its first reason."""
    from vllm_omni_ascend_opt import api

    out = {}
    for row in api.status():
        if row["installed"]:
            continue
        reasons = row["reasons_inactive"] or ["waits for its vLLM-Omni modules to be imported"]
        out[row["name"]] = reasons[0]
    return out


def status_line() -> str:
    from vllm_omni_ascend_opt import api, flags

    installed = api.installed()
    off = "; ".join(f"{n} ({why})" for n, why in off_reasons().items()) or "nothing"
    spec = os.environ.get(flags.ENV_FLAG)
    return (
        f"vllm-omni-ascend-opt {_version()} ({flags.ENV_FLAG}={spec if spec is not None else '<unset: default>'}): "
        f"installed {', '.join(installed) or 'nothing'}; off: {off}"
    )


def announce(force: bool = False) -> bool:
    """Log the status line once per process. Without ``force`` only when the selection is settled."""
    global _announced
    if _announced:
        return False
    if not force and pending():
        return False
    _announced = True
    logger.info("%s", status_line())
    return True


def pending() -> list[str]:
    """Selected optimizations that can be active but are not installed yet (their modules are not imported)."""
    from vllm_omni_ascend_opt import _plugin, flags, registry

    if _plugin.config_error() or (_plugin.version_error() and not flags.force_from_env()):
        return []
    out = []
    for name in _plugin.selected():
        opt = registry.get(name)
        if not opt.installed and not opt.reasons_inactive():
            out.append(name)
    return out


def _reset_for_tests() -> None:
    global _announced
    _announced = False


# ----------------------------------------------------------------------------------------------------------------
# status file
# ----------------------------------------------------------------------------------------------------------------
def status_file_path() -> Path | None:
    raw = os.environ.get(ENV_STATUS_FILE)
    if not raw:
        return None
    return Path(raw.replace("{pid}", str(os.getpid())))


def _tensor_bytes(obj: Any) -> int:
    import torch

    total = 0
    for name in getattr(obj, "__slots__", ()) or vars(obj):
        value = getattr(obj, name, None)
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
    return total


def cache_memory() -> dict[str, dict[str, Any]]:
    """Bytes held by the plugin's process-wide caches, with their budgets (read-only introspection)."""
    from vllm_omni_ascend_opt import registry

    out: dict[str, dict[str, Any]] = {}
    names = registry.names()
    if "shared_modulation" in names:
        memo = getattr(registry.get("shared_modulation"), "memo", None)
        if memo is not None:
            out["shared_modulation"] = {
                "bytes": int(memo.nbytes),
                "budget_bytes": int(memo.max_bytes),
                "entries": len(memo),
                "evictions": int(getattr(memo, "stats", {}).get("evictions", 0)),
            }
    if "rope" in names:
        rope = registry.get("rope")
        cache = getattr(rope, "_tables", None)
        entries = list(getattr(cache, "_entries", {}).values())
        from vllm_omni_ascend_opt.opts import rope as rope_mod

        out["rope"] = {
            "tables": len(entries),
            "table_cap": int(getattr(rope_mod, "_TABLE_CACHE_SIZE", 0)),
            "bytes": sum(_tensor_bytes(t) for _ref, t in entries),
        }
    return out


def status_report(model: Any = None) -> dict[str, Any]:
    from vllm_omni_ascend_opt import _plugin, api, flags, registry

    report: dict[str, Any] = {
        "pid": os.getpid(),
        "version": _version(),
        "flag": os.environ.get(flags.ENV_FLAG),
        "registered": bool(_plugin._registered),
        "config_error": _plugin.config_error(),
        "version_error": _plugin.version_error(),
        "selected": _plugin.selected(),
        "installed": api.installed(),
        "off": off_reasons(),
        "memory": cache_memory(),
        "requests": _requests.get("n", 0),
    }
    try:
        from vllm_omni_ascend_opt.testbed.runtime import engine_cpu_runtime_applied

        report["cpu_runtime"] = engine_cpu_runtime_applied()
    except Exception:  # the test bed is optional here
        report["cpu_runtime"] = []
    if model is not None:
        report["pipeline"] = type(model).__name__
        report["acting_on_pipeline"] = [
            o.name
            for o in registry.all_optimizations()
            if o.installed and o.is_attached(model) and not o.model_reasons_inactive(model)
        ]
    return report


_requests: dict[str, int] = {}
_model_ref: dict[str, Any] = {}


def write_status_file(model: Any = None) -> Path | None:
    """Write the report to ``$VLLM_OMNI_ASCEND_OPT_STATUS_FILE`` (atomically); None when the variable is unset."""
    path = status_file_path()
    if path is None:
        return None
    if model is None:
        model = _model_ref.get("model")
    with _write_lock:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(status_report(model), indent=1, sort_keys=True))
        os.replace(tmp, path)
    return path


def write_status_file_safely(model: Any = None) -> None:
    """:func:`write_status_file`, logging (never raising) a failure: reporting must not break the engine."""
    try:
        write_status_file(model)
    except Exception:
        logger.exception("vllm-omni-ascend-opt: writing the status file failed")


def track_model(model: Any) -> None:
    """After vLLM-Omni's loader built ``model``: write the status file now and after each ``forward`` (only when
    ``VLLM_OMNI_ASCEND_OPT_STATUS_FILE`` is set; otherwise the model is left untouched)."""
    if status_file_path() is None:
        return
    _model_ref["model"] = model
    forward = getattr(model, "forward", None)
    if forward is not None and not getattr(forward, "_ascend_opt_status", False):

        @functools.wraps(forward)
        def forward_then_report(*args: Any, **kwargs: Any) -> Any:
            out = forward(*args, **kwargs)
            _requests["n"] = _requests.get("n", 0) + 1
            write_status_file_safely(model)
            return out

        forward_then_report._ascend_opt_status = True  # type: ignore[attr-defined]
        model.forward = forward_then_report
    write_status_file_safely(model)
