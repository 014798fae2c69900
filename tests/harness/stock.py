"""Stock's result first, then a spec selected: the setup of the equality tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from vllm_omni_ascend_opt import api

T = TypeVar("T")


def stock_then(spec: str, model: Any, run: Callable[[], T]) -> T:
    """``run()`` with nothing selected on ``model`` (stock), then ``spec`` selected; returns stock's result."""
    api.select("none", model=model)
    ref = run()
    api.select(spec, model=model)
    return ref
