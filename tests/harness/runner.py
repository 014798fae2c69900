"""vLLM-Omni's own ``DiffusionModelRunner`` on the test bed (``testbed/model_runner.py``), loaded for one test."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from vllm_omni_ascend_opt import api
from vllm_omni_ascend_opt.testbed.model_runner import RunnerHarness


@contextmanager
def loaded(runtime: Any, spec: str | None = None, **fields: Any) -> Iterator[RunnerHarness]:
    """The tiny model loaded with ``OmniDiffusionConfig`` ``fields`` after ``spec``; closed, none selected, after."""
    if spec is not None:
        api.select(spec)
    h = RunnerHarness.load(runtime, **fields)
    try:
        yield h
    finally:
        h.close()
        api.select("none")
