"""Under vLLM-Omni's torch.compile (regional and full), forced on the CPU runtime through its own runner: the plugin's
bookkeeping stays out of the traced code. Compiled default is pixel-identical to compiled stock (inductor reorders
float math, so bitwise is not the bar), repeated requests are identical, nothing recompiles after the first request
of a shape, the plugin causes no graph break, and the status says which optimizations the compiled model uses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from vllm_omni_ascend_opt import _report, api
from vllm_omni_ascend_opt.metrics import to_uint8
from vllm_omni_ascend_opt.testbed.runner import RunnerHarness

pytestmark = pytest.mark.slow

GRANULARITIES = ("regional", "full")
REQUESTS = 3


@dataclass
class CompiledRun:
    images: list[torch.Tensor]
    frames: list[int]  # dynamo frames compiled so far, after each request
    graph_breaks: int
    hit_recompile_limit: bool
    status: dict[str, Any]
    reasons: dict[str, list[str]]


def _compiled_run(runtime: Any, spec: str, granularity: str) -> CompiledRun:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    api.select(spec)
    h = RunnerHarness.load(runtime, compile=True, diffusion_compile_granularity=granularity)
    try:
        images, frames = [], []
        for _ in range(REQUESTS):
            images.append(h.generate(height=32, width=32, steps=2, cfg_scale=4.0))
            frames.append(int(counters["frames"]["total"]))
        pipe = h.pipeline
        return CompiledRun(
            images=images,
            frames=frames,
            graph_breaks=sum(counters["graph_break"].values()),
            hit_recompile_limit=any("recompile" in k.lower() for k in counters["unimplemented"]),
            status=_report.status_report(pipe),
            reasons=_report.off_reasons(pipe),
        )
    finally:
        h.close()
        api.select("none")


@pytest.fixture(scope="module")
def compiled(runtime) -> dict[tuple[str, str], CompiledRun]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # compiled code on CPU: one thread, as the other tests' second core may be busy
    try:
        return {(g, spec): _compiled_run(runtime, spec, g) for g in GRANULARITIES for spec in ("none", "default")}
    finally:
        torch._dynamo.reset()
        torch.set_num_threads(threads)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_compiled_default_is_pixel_identical_to_compiled_stock(compiled, granularity):
    stock, default = compiled[(granularity, "none")], compiled[(granularity, "default")]
    for a, b in zip(stock.images, default.images, strict=True):
        assert a.abs().sum() > 0
        assert (to_uint8(a) == to_uint8(b)).all()


@pytest.mark.parametrize("spec", ["none", "default"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_repeated_requests_are_identical_and_compile_once(compiled, granularity, spec):
    run = compiled[(granularity, spec)]
    assert all(torch.equal(run.images[0], x) for x in run.images[1:])
    assert run.frames[0] > 0 and run.frames[-1] == run.frames[0], run.frames  # no recompile after request 1
    assert not run.hit_recompile_limit


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_the_plugin_causes_no_graph_break(compiled, granularity):
    assert compiled[(granularity, "default")].graph_breaks == compiled[(granularity, "none")].graph_breaks


def test_status_says_what_the_compiled_model_uses(compiled):
    regional, full = compiled[("regional", "default")], compiled[("full", "default")]
    assert regional.status["compiled_regions"] == ["block"]
    assert full.status["compiled_regions"] == ["block", "transformer"]
    # regional: the blocks are compiled; what lives only in them steps aside, the rest acts outside them
    assert {"shared_modulation", "rope", "vae_exact"} <= set(regional.status["acting_on_pipeline"])
    assert "torch.compile runs the transformer blocks" in regional.reasons["joint_attention"][0]
    # full: the whole transformer is compiled; only the VAE's optimization acts
    assert "vae_exact" in full.status["acting_on_pipeline"]
    for name in ("shared_modulation", "rope", "joint_attention"):
        assert "torch.compile runs the whole transformer" in full.reasons[name][0], full.reasons[name]


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_status_of_a_compiled_transformer_without_inductor(runtime, granularity):
    """The same status facts on a transformer compiled the way vLLM-Omni's runner does (regional: each repeated
    block's forward; full: ``module.compile()``), with dynamo's eager backend: nothing is compiled until it runs, so
    this is cheap, and the status is read from the model alone."""
    from vllm_omni.diffusion.compile import regionally_compile

    from vllm_omni_ascend_opt import registry
    from vllm_omni_ascend_opt.blocks import guards
    from vllm_omni_ascend_opt.blocks.targets import TRANSFORMER
    from vllm_omni_ascend_opt.testbed import TINY
    from vllm_omni_ascend_opt.testbed.tiny_model import random_transformer_state_dict

    api.select("default")
    mod = __import__(TRANSFORMER, fromlist=["QwenImageTransformer2DModel"])
    with runtime.context():
        tr = mod.QwenImageTransformer2DModel(od_config=runtime.od_config, **TINY.transformer_kwargs())
    tr.load_weights(random_transformer_state_dict(TINY, 0).items())
    api.select("default", model=tr)
    assert guards.compiled_regions(tr) == frozenset()
    assert _report.explain(registry.get("joint_attention"), tr) == []
    if granularity == "full":
        tr.compile(backend="eager")
        assert guards.compiled_regions(tr) == {"block", "transformer"}
        acting = {"vae_exact"}
    else:
        regionally_compile(tr, backend="eager")
        assert guards.compiled_regions(tr) == {"block"}
        acting = {"shared_modulation", "rope"}
    reasons = {n: _report.explain(registry.get(n), tr) for n in ("shared_modulation", "rope", "joint_attention")}
    assert "torch.compile runs" in reasons["joint_attention"][0]
    for name in ("shared_modulation", "rope"):
        assert (reasons[name] == []) is (name in acting), (name, reasons[name])
