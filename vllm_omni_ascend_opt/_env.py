"""Reading the plugin's environment variables: every value is answered, none is taken in silence. An unknown boolean
spelling keeps the default (:func:`boolean`) and a budget outside its sane range is used as given
(:func:`check_range`), each with one warning.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("vllm_omni_ascend_opt")

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off", "")
_warned: set[tuple[str, str]] = set()


def boolean(name: str, default: bool = False) -> bool:
    """The boolean value of environment variable ``name`` (unset: ``default``)."""
    if (raw := os.environ.get(name)) is None:
        return default
    if (v := raw.strip().lower()) in TRUE + FALSE:
        return v in TRUE
    _warn_once(
        name,
        raw,
        f"{name}={raw!r} is not a boolean ({'/'.join(TRUE)} or {'/'.join(FALSE[:-1])}): using "
        f"{'true' if default else 'false'}",
    )
    return default


def check_range(name: str, value: float, lo: float, hi: float, unit: str = "") -> float:
    """``value`` (of variable ``name``), with one warning when it is outside ``[lo, hi]``."""
    if not lo <= value <= hi:
        _warn_once(
            name, str(value), f"{name}={value:g}{unit} is outside the sane range {lo:g}..{hi:g}{unit}; used as given"
        )
    return value


def _warn_once(name: str, raw: str, message: str) -> None:
    if (name, raw) not in _warned:
        _warned.add((name, raw))
        logger.warning("vllm-omni-ascend-opt: %s", message)
