"""The one place that decides whether Ascend kernels can be used in this process: :func:`torch_npu_module` (the
imported ``torch_npu`` or ``None``) and :func:`npu_unavailable_reasons`. Tests put a fake ``torch_npu`` module into
``sys.modules`` before asking; the package itself never ships a fake.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import sys
from types import ModuleType

import torch

_CACHE: dict[str, object] = {}
_PROBES = itertools.count(1)


def reset_cache() -> None:
    """Forget the probe result (tests swap the torch_npu module in and out)."""
    _CACHE.clear()


def torch_npu_module() -> ModuleType | None:
    """``torch_npu`` if it imports and an NPU device is usable, else ``None``."""
    if "mod" not in _CACHE:
        _CACHE["mod"], _CACHE["why"] = _probe()
        _CACHE["probe"] = next(_PROBES)
    return _CACHE["mod"]  # type: ignore[return-value]


def probe_id() -> int:
    """A number that changes whenever the backend is probed afresh (unlike ``id(module)``, never reused)."""
    torch_npu_module()
    return int(_CACHE["probe"])  # type: ignore[call-overload]


def npu_unavailable_reasons() -> list[str]:
    """Empty when NPU kernels can run here; otherwise the reasons, in words."""
    torch_npu_module()
    why = _CACHE["why"]
    return [why] if why else []


def _probe() -> tuple[ModuleType | None, str]:
    if (mod := sys.modules.get("torch_npu")) is None:
        try:
            mod = importlib.import_module("torch_npu")
        except ImportError as exc:
            return None, f"torch_npu is not installed ({exc.__class__.__name__}: {exc})"
        except Exception as exc:  # a broken CANN install raises all sorts of errors
            return None, f"torch_npu failed to import: {exc!r}"
    npu = getattr(torch, "npu", None)
    try:
        available = bool(npu is not None and npu.is_available() and npu.device_count() > 0)
    except Exception as exc:
        return None, f"torch.npu.is_available() failed: {exc!r}"
    if not available:
        return None, "torch_npu is importable but no NPU device is visible"
    return mod, ""


def cann_version() -> str | None:
    """The CANN version torch_npu reports; None without a usable torch_npu or when it cannot tell."""
    if torch_npu_module() is None:
        return None
    try:
        return str(torch.npu.utils.get_cann_version(module="CANN")) or None
    except Exception:
        return None


def is_npu_tensor(t: torch.Tensor) -> bool:
    """``t.is_npu`` when torch_npu is usable, else False (through the tensor, so that the test fake answers too)."""
    return torch_npu_module() is not None and bool(getattr(t, "is_npu", False))


def backend_label() -> str:
    """``torch_npu <version>`` of the module in use, for reasons and notes (``"no torch_npu"`` when there is none)."""
    mod = torch_npu_module()
    return "no torch_npu" if mod is None else f"torch_npu {getattr(mod, '__version__', '?')}"


def graph_capture_reason() -> str | None:
    """Why the current stream is being captured into a graph (CUDA or NPU), or None; never raises."""
    if "cuda" not in _CACHE:
        _CACHE["cuda"] = torch.cuda.is_available()
    with contextlib.suppress(Exception):
        if _CACHE["cuda"] and torch.cuda.is_current_stream_capturing():
            return "CUDA graph capture in progress"
        probe = getattr(getattr(torch, "npu", None), "is_current_stream_capturing", None)
        if probe is not None and torch_npu_module() is not None and probe():
            return "NPU graph capture in progress"
    return None


def npu_device() -> torch.device:
    """The NPU this process uses (only meaningful when :func:`torch_npu_module` is not ``None``)."""
    return torch.device("npu", torch.npu.current_device())


def synchronize(device: torch.device | str | None) -> None:
    """Wait for queued work on ``device`` (NPU, CUDA or nothing to do on CPU)."""
    if device is not None and (kind := torch.device(device).type) in ("cuda", "npu"):
        getattr(torch, kind).synchronize()
