"""Kernel verdicts saved on disk, so that a restart, another worker or another rank of the machine starts warm.

Where: ``$VLLM_OMNI_ASCEND_OPT_VERDICT_CACHE`` (a directory; ``0``/``off``/``none``/``false`` disables it), else
``$XDG_CACHE_HOME/vllm-omni-ascend-opt/verdicts`` (``~/.cache/...`` without it). What: one JSON file per environment
(device, SoC, CANN, torch_npu, torch, plugin version; named by their digest) holding ``{kernel: {shape class: [ok,
reason, timing]}}`` (format 2; timing: :func:`.timing.report` or null; format 1's ``[ok, reason]`` still reads), the
device index dropped from the key (``npu:3`` -> ``npu``). Never faults.

A write takes an exclusive ``flock`` beside the file, re-reads, merges, and renames a temporary file over it: no torn
file, no lost entry. A file that does not parse or was made for another format or environment is ignored with one
warning. A class is asked of the disk once per backend probe (:func:`lookup_once`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import threading
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import torch

from vllm_omni_ascend_opt import _backend, _env
from vllm_omni_ascend_opt._version import __version__

logger = logging.getLogger("vllm_omni_ascend_opt")

ENV_VERDICT_CACHE = "VLLM_OMNI_ASCEND_OPT_VERDICT_CACHE"
FORMAT = 2
#: formats this version reads (1: ``[ok, reason]`` without timing)
READS = (1, 2)
#: What turns the cache off: the boolean false spellings (an empty value means the default directory), and these.
_OFF = (*(v for v in _env.FALSE if v), "none", "disabled")
_lock = threading.Lock()
#: path -> {kernel: {key: [ok, reason]}}, loaded once per path and probe
_loaded: dict[str, Any] = {}
_warned: set[str] = set()
#: (probe, kernel, key text) already asked of the disk by :func:`lookup_once`
_asked: set[tuple[int, str, str]] = set()


def directory() -> Path | None:
    """The verdict cache directory, or None when it is disabled."""
    raw = os.environ.get(ENV_VERDICT_CACHE)
    if raw is not None and raw.strip().lower() in _OFF:
        return None
    if raw and raw.strip():
        return Path(raw.strip()).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vllm-omni-ascend-opt" / "verdicts"


def environment() -> dict[str, str]:
    """What a saved verdict is valid for: the device, its software stack and this plugin's version."""
    mod = _backend.torch_npu_module()
    npu = getattr(torch, "npu", None)

    def ask(fn: Any) -> str:
        try:
            return str(fn())
        except Exception:
            return "?"

    return {
        "device": ask(lambda: npu.get_device_name()),  # type: ignore[union-attr]
        "soc": ask(lambda: npu.get_soc_version()),  # type: ignore[union-attr]
        "cann": _backend.cann_version() or "?",
        "torch_npu": str(getattr(mod, "__version__", "?")),
        "torch": torch.__version__,
        "plugin": __version__,
    }


def path() -> Path | None:
    """This environment's file, or None (disabled, or no torch_npu: nothing to verify)."""
    d = directory()
    if d is None or _backend.torch_npu_module() is None:
        return None
    env = json.dumps(environment(), sort_keys=True)
    return d / f"verdicts-{hashlib.sha256(env.encode()).hexdigest()[:16]}.json"


def key_text(key: Hashable) -> str:
    """A shape-class key as saved: its parts as text, the device index dropped."""
    parts = key if isinstance(key, tuple) else (key,)
    return "|".join(re.sub(r"^(npu|cuda):\d+$", r"\1", str(p).removeprefix("torch.")) for p in parts)


def _read(p: Path) -> dict[str, Any]:
    """The verdicts of ``p`` ({} when missing; ignored, with one warning, when corrupt, foreign or older)."""
    try:
        raw = p.read_text()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        return _ignore(p, f"unreadable ({exc})")
    try:
        data = json.loads(raw)
    except ValueError:
        return _ignore(p, "not valid JSON")
    if not isinstance(data, dict) or data.get("format") not in READS:
        return _ignore(p, f"format {data.get('format') if isinstance(data, dict) else '?'} is not {FORMAT}")
    if data.get("env") != environment():
        return _ignore(p, "made for another device or software stack")
    verdicts = data.get("verdicts")
    return verdicts if isinstance(verdicts, dict) else _ignore(p, "no verdict table")


def _ignore(p: Path, why: str) -> dict[str, Any]:
    if str(p) not in _warned:
        _warned.add(str(p))
        logger.warning("vllm-omni-ascend-opt: ignoring the saved kernel verdicts in %s: %s", p, why)
    return {}


def _table() -> tuple[Path | None, dict[str, Any]]:
    p = path()
    if p is None:
        return None, {}
    tag = f"{p}#{_backend.probe_id()}"
    if tag not in _loaded:
        _loaded[tag] = _read(p)
    return p, _loaded[tag]


def lookup(kernel: str, key: Hashable) -> tuple[bool, str, dict[str, Any] | None] | None:
    """The saved ``(ok, reason, timing)`` of ``kernel`` at ``key``, or None (not saved, or the cache is off)."""
    with _lock:
        _, table = _table()
        hit = table.get(kernel, {}).get(key_text(key))
    if isinstance(hit, list) and len(hit) in (2, 3) and isinstance(hit[0], bool):
        t = hit[2] if len(hit) == 3 and isinstance(hit[2], dict) else None
        return hit[0], str(hit[1]), t
    return None


def lookup_once(kernel: str, key: Hashable) -> tuple[bool, str, dict[str, Any] | None] | None:
    """:func:`lookup`, the first time ``kernel`` asks for ``key`` under the current probe; None after that."""
    tag = (_backend.probe_id(), kernel, key_text(key))
    if tag in _asked:
        return None
    _asked.add(tag)
    return lookup(kernel, key)


def ask_again(kernel: str) -> None:
    """Let :func:`lookup_once` read ``kernel``'s classes again (its path dropped what it knew)."""
    _asked.difference_update({t for t in _asked if t[1] == kernel})


def save(kernel: str, key: Hashable, ok: bool, reason: str, timing: dict[str, Any] | None = None) -> None:
    """Save a verdict (atomically; a failure to write is logged once and never raised)."""
    with _lock:
        p, table = _table()
        if p is None:
            return
        table.setdefault(kernel, {})[key_text(key)] = [bool(ok), reason[:500], timing]
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            with open(p.with_name(p.name + ".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # read-merge-write by one process at a time: no lost entry
                merged = _read(p)
                for k, entries in table.items():
                    merged.setdefault(k, {}).update(entries)
                tmp = p.with_name(f".{p.name}.{os.getpid()}.{threading.get_ident()}.tmp")
                tmp.write_text(json.dumps({"format": FORMAT, "env": environment(), "verdicts": merged}, sort_keys=True))
                os.replace(tmp, p)  # readers see the old file or the new one, never a torn one
        except OSError as exc:
            if str(p) + "#write" not in _warned:
                _warned.add(str(p) + "#write")
                logger.warning("vllm-omni-ascend-opt: cannot save kernel verdicts to %s: %s", p, exc)


def entries() -> int:
    """Saved verdicts known to this process (for status)."""
    with _lock:
        _, table = _table()
        return sum(len(v) for v in table.values() if isinstance(v, dict))


def forget() -> None:
    """Drop what this process loaded (tests; the next lookup reads the file again)."""
    with _lock:
        _loaded.clear()
        _warned.clear()
        _asked.clear()
