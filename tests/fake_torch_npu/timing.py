"""The fake's device clock: a deterministic plan of each fake kernel call's device time, read by ``torch.npu.Event``.

Tests configure ``mod.timing``: ``set(kernel, ms)`` (a number or a function of the call's arguments) and ``stock``
for a timed region in which no fake kernel ran. Defaults: every kernel 0.5 ms, stock 1.0 ms; ``npu_quant_matmul``
1.0 ms with an ND ``x2`` and 0.5 ms with a FRACTAL_NZ one (:meth:`TimingPlan.by_weight_format`). ``Event`` has
torch_npu 2.13.0's signature (``enable_timing``, ``blocking``, ``interprocess``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tests.fake_torch_npu import formats

DEFAULT_KERNEL_MS, DEFAULT_STOCK_MS = 0.5, 1.0


class TimingPlan:
    """Device time per fake kernel call; ``elapsed`` counts the timed regions read (``elapsed_time`` calls)."""

    def __init__(self) -> None:
        self.costs: dict[str, float | Callable[..., float]] = {}
        self.stock: float | Callable[[], float] = DEFAULT_STOCK_MS
        self.clock = 0.0
        self.calls = 0
        self.elapsed = 0
        self.by_weight_format("npu_quant_matmul", DEFAULT_STOCK_MS, DEFAULT_KERNEL_MS)

    def set(self, kernel: str, ms: float | Callable[..., float]) -> None:
        self.costs[kernel] = ms

    def by_weight_format(self, kernel: str, nd_ms: float, nz_ms: float) -> None:
        """``kernel`` (``x1``, ``x2``, ...) costs ``nz_ms`` when ``x2`` is FRACTAL_NZ on the NPU, else ``nd_ms``."""

        def cost(*args: Any, **kwargs: Any) -> float:
            x2 = args[1] if len(args) > 1 else kwargs.get("x2")
            nz = (
                isinstance(x2, torch.Tensor) and formats.on_npu(x2) and formats.get_npu_format(x2) == formats.FRACTAL_NZ
            )
            return nz_ms if nz else nd_ms

        self.set(kernel, cost)

    def tick(self, kernel: str, args: tuple, kwargs: dict) -> None:
        """One call of ``kernel`` ran on the device: the clock advances by its planned time."""
        cost = self.costs.get(kernel, DEFAULT_KERNEL_MS)
        self.clock += float(cost(*args, **kwargs) if callable(cost) else cost)
        self.calls += 1

    def event_class(self) -> type:
        plan = self

        class Event:
            def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
                self.enable_timing = enable_timing
                self.at: tuple[float, int] | None = None

            def record(self, stream: Any = None) -> None:
                self.at = (plan.clock, plan.calls)

            def synchronize(self) -> None:
                return None

            def query(self) -> bool:
                return True

            def elapsed_time(self, end: Event) -> float:
                if not (self.enable_timing and end.enable_timing) or self.at is None or end.at is None:
                    raise RuntimeError("Both events must be recorded with enable_timing=True")  # as on the device
                plan.elapsed += 1
                if end.at[1] == self.at[1]:  # no fake kernel ran in between: the stock path
                    return float(plan.stock() if callable(plan.stock) else plan.stock)
                return end.at[0] - self.at[0]

        return Event
