"""Stock's result first, then a spec selected: the setup of the equality tests; and a warm block's op counts."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from vllm_omni_ascend_opt import api
from vllm_omni_ascend_opt.testbed.opcount import count_module_calls
from vllm_omni_ascend_opt.testbed.pipeline import generate

T = TypeVar("T")


def stock_then(spec: str, model: Any, run: Callable[[], T]) -> T:
    """``run()`` with nothing selected on ``model`` (stock), then ``spec`` selected; returns stock's result."""
    api.select("none", model=model)
    ref = run()
    api.select(spec, model=model)
    return ref


def warm_block(pipe: Any, rt: Any, spec: str, **kw: Any) -> tuple[Counter, torch.Tensor]:
    """Select ``spec``; op counts of the last block on a repeated (warm) request, and its images."""
    api.select(spec, model=pipe)
    generate(pipe, rt, **kw)
    with count_module_calls(pipe.transformer.transformer_blocks[-1]) as calls:
        images = generate(pipe, rt, **kw).images
    assert calls[0].counts == calls[-1].counts
    return calls[-1].counts, images
