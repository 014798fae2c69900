"""The guard around every on-device check and the kernel call it vets: a fault costs one call, never a request.

A **verdict** (the kernel disagrees with its reference, or rejects the call with a TypeError/ValueError) is stored by
the kernel path (:mod:`.verified`). A **fault** (out of memory, a driver's runtime error) is not: the call runs stock
and the key is retried after :data:`RETRY_AFTER` forwards, doubling up to :data:`RETRY_CAP`; after :data:`MAX_ERRORS`
errors in a row it is demoted (stock until the next backend probe). A **deferral** (the check's scratch would not fit
in free device memory) backs off the same way without counting as an error. The clock: ``forward_scope.forwards()``.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from vllm_omni_ascend_opt.blocks.kernels.verdicts import ProbeDict
from vllm_omni_ascend_opt.blocks.upstream import forward_scope

logger = logging.getLogger("vllm_omni_ascend_opt")
T = TypeVar("T")

#: Backoff, in transformer forwards: the first retry after this many, then doubling, never longer than the cap.
RETRY_AFTER = 1
RETRY_CAP = 32
#: Errors in a row (no success between them) after which a shape class is demoted to stock.
MAX_ERRORS = 6


def bucket(n: int) -> int:
    """The next power of two >= n: the shape-class bucket of a size (every kernel's shape classes use it)."""
    return 1 << max(0, (n - 1).bit_length())


def fault_kind(exc: BaseException) -> str:
    """The fault's kind: "out of memory", "runtime error" or the exception's class name (for status and the log)."""
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower():
        return "out of memory"
    if isinstance(exc, RuntimeError):
        return "runtime error"
    return exc.__class__.__name__


def is_error(exc: BaseException) -> bool:
    """An error of the moment, retried (out of memory, a driver or runtime error), not a verdict about the kernel."""
    return isinstance(exc, (RuntimeError, MemoryError)) and not isinstance(exc, NotImplementedError)


@dataclass
class Fault:
    """The last fault of one shape class: its kind, how many in a row, and when the class is tried again."""

    key: Hashable
    kind: str
    error: str
    errors: int = 0  # errors in a row (deferrals are not errors)
    retry_at: int = 0  # forward number (forward_scope.forwards()) from which the class is tried again
    demoted: bool = False
    deferrals: int = 0

    def describe(self) -> str:
        if self.demoted:
            return f"demoted to stock after {self.errors} errors in a row (last: {self.kind}: {self.error})"
        if self.kind == "deferred":
            return f"check deferred ({self.error}); retried from forward {self.retry_at}"
        return f"{self.kind} ({self.error}); stock for now, retried from forward {self.retry_at} (error {self.errors})"


class Guard:
    """The faults of one owner's kernel per shape class; counts into the owner's ``stats`` and logs with ``label``."""

    def __init__(self, label: str, stats: Counter) -> None:
        self.label = label
        self.stats = stats
        self._faults: ProbeDict[Fault] = ProbeDict()
        #: Largest fp32 scratch a check of this owner was sized to (bytes), for status.
        self.scratch_peak = 0

    def clear(self) -> None:
        self._faults.clear()

    def faults(self) -> list[Fault]:
        return self._faults.values()

    def fault(self, key: Hashable) -> Fault | None:
        return self._faults.get(key) if self._faults else None

    def waits(self, key: Hashable) -> bool:
        """Whether ``key`` stays on stock now (backoff running, or demoted)."""
        f = self.fault(key)  # the hot path: one length check when no fault anywhere
        return f is not None and (f.demoted or forward_scope.forwards() < f.retry_at)

    def run(self, key: Hashable, fn: Callable[[], T]) -> tuple[bool, T | None, str]:
        """Run ``fn`` (a check, a kernel call, or both) under the guard: ``(True, fn(), "")``; ``(False, None, "")``
        after an error of the moment (recorded, retried with backoff); ``(False, None, reason)`` when it raised
        anything else (the kernel rejects this call for good: a verdict the caller stores). A success clears a fault."""
        before = self.fault(key)
        try:
            out = fn()
        except Exception as exc:
            if not is_error(exc):
                return False, None, f"the kernel raised {exc.__class__.__name__}: {exc}"
            self.record(key, exc)
            return False, None, ""
        if before is not None and self._faults.get(key) is before:  # not a deferral made by fn just now
            self._faults.live().pop(key, None)
            self.stats["recovered"] += 1
            logger.info("vllm-omni-ascend-opt: %s: the kernel works again at %s", self.label, where(key))
        return True, out, ""

    def record(self, key: Hashable, exc: BaseException) -> None:
        """Count one error of ``key`` and schedule its retry (or demote it)."""
        prev = self._faults.get(key) or Fault(key, "", "")
        errors = prev.errors + 1
        why = f"raised {exc.__class__.__name__}: {exc}"[:300]
        f = Fault(key, fault_kind(exc), why, errors, demoted=errors >= MAX_ERRORS, deferrals=prev.deferrals)
        self._put(f, errors - 1, "faults", logger.warning)

    def fits(self, key: Hashable, device: torch.device, scratch_bytes: int) -> bool:
        """Whether a check needing ``scratch_bytes`` fits in ``device``'s free memory now (else it is deferred, with
        backoff); True where the backend cannot tell."""
        self.scratch_peak = max(self.scratch_peak, scratch_bytes)
        free = free_device_memory(device)
        if free is None or scratch_bytes <= free:
            return True
        prev = self._faults.get(key) or Fault(key, "", "")
        why = f"needs {scratch_bytes / 2**20:.0f} MiB of scratch, {free / 2**20:.0f} MiB free"
        f = Fault(key, "deferred", why, prev.errors, deferrals=prev.deferrals + 1)
        self._put(f, min(f.deferrals - 1, 16), "deferred_checks", logger.info)
        return False

    def _put(self, f: Fault, backoff: int, counter: str, log: Callable[..., None]) -> None:
        f.retry_at = forward_scope.forwards() + min(RETRY_CAP, RETRY_AFTER << backoff)
        self._faults.put(f.key, f)
        self.stats[counter] += 1
        log("vllm-omni-ascend-opt: %s at %s: %s", self.label, where(f.key), f.describe())


def free_device_memory(device: torch.device) -> int | None:
    """Free bytes on ``device`` as the backend reports them (``torch.npu.mem_get_info``), or None when it cannot."""
    get = getattr(getattr(torch, "npu", None), "mem_get_info", None)
    try:  # None (no torch.npu.mem_get_info) raises too
        return int(get(device)[0]) if device.type != "cpu" else int(get()[0])  # the fake's CPU "device"
    except Exception:
        return None


def where(key: Any) -> str:
    return "/".join(str(k).removeprefix("torch.") for k in key) if isinstance(key, tuple) else str(key)
