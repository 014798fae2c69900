"""Under vLLM-Omni's torch.compile (regional and full), forced on the CPU runtime through its own runner.

Compiled default is pixel-identical to compiled stock (inductor reorders float math) and the fast tier within its
gates; repeats are identical and nothing recompiles; the plugin causes no graph break; the compiled graphs run fewer
ops with the default stack; the value-keyed work (memo, RoPE tables) runs in eager hooks and reaches the compiled
blocks as ready tensors (regional); the status says truthfully what acts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from tests.harness import LogLines
from tests.harness.forward import build
from tests.harness.runner import loaded
from vllm_omni_ascend_opt import _report, api, registry
from vllm_omni_ascend_opt.ablation.metrics import compare_images, to_uint8
from vllm_omni_ascend_opt.blocks.body import compiled_blocks
from vllm_omni_ascend_opt.blocks.body.block_body import READY
from vllm_omni_ascend_opt.blocks.body.joint_qkv import READY_ROPE
from vllm_omni_ascend_opt.opts._fast_tier import FAST_TIER_GATES

pytestmark = pytest.mark.slow

GRANULARITIES = ("regional", "full")
REQUESTS = 3
FAST = "default,+fast_modulate,+fast_residual"
#: (granularity, spec) compiled: stock and default under both; the fast tier where it acts (regional)
RUNS = [(g, s) for g in GRANULARITIES for s in ("none", "default")] + [("regional", FAST)]
#: dynamo's loggers of graph breaks (records carry "in user code at <file>:<line>")
GRAPH_BREAK_LOGGERS = (
    "torch._dynamo.symbolic_convert.__graph_breaks",
    "torch._dynamo.convert_frame.__graph_breaks",
    "torch._dynamo.exc.__graph_breaks",
)


@dataclass
class CompiledRun:
    images: list[torch.Tensor]
    frames: list[int]  # dynamo frames compiled so far, after each request
    graph_breaks: int
    hit_recompile_limit: bool
    status: dict[str, Any]
    reasons: dict[str, list[str]]
    #: the first request's graphs: ops dynamo captured, IR nodes before fusion, kernels (per block under regional)
    captured: int = 0
    ir_nodes: int = 0
    kernels: int = 0
    break_sites: list[str] = field(default_factory=list)
    memo_hits: int = 0
    hoisted: dict[str, bool] = field(default_factory=dict)


def _compiled_run(runtime: Any, granularity: str, spec: str) -> CompiledRun:
    from torch._dynamo.utils import counters
    from torch._inductor import metrics

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # compiled code on CPU: one thread, as the other tests' second core may be busy
    breaks = LogLines()
    torch._logging.set_logs(graph_breaks=True)
    loggers = [logging.getLogger(name) for name in GRAPH_BREAK_LOGGERS]
    for lg in loggers:
        lg.addHandler(breaks)
    torch._dynamo.reset()
    counters.clear()
    metrics.reset()
    try:
        with loaded(runtime, spec, compile=True, diffusion_compile_granularity=granularity) as h:
            images, frames = [], []
            for i in range(REQUESTS):
                images.append(h.generate(height=32, width=32, steps=2, cfg_scale=4.0))
                frames.append(int(counters["frames"]["total"]))
                if i == 0:
                    captured = int(counters["stats"]["calls_captured"])
                    ir_nodes, kernels = int(metrics.ir_nodes_pre_fusion), int(metrics.generated_kernel_count)
            pipe = h.pipeline
            block = pipe.transformer.transformer_blocks[0]
            return CompiledRun(
                images=images,
                frames=frames,
                graph_breaks=sum(counters["graph_break"].values()),
                hit_recompile_limit=any("recompile" in k.lower() for k in counters["unimplemented"]),
                status=_report.status_report(pipe),
                reasons=_report.off_reasons(pipe),
                captured=captured,
                ir_nodes=ir_nodes,
                kernels=kernels,
                break_sites=[m.split("\n")[0] for m in breaks.lines],
                memo_hits=int(registry.get("shared_modulation").stats["hits"]),
                hoisted={
                    "modulation": compiled_blocks.ready(block, READY) is not None,
                    "rope": compiled_blocks.ready(block.attn, READY_ROPE) is not None,
                },
            )
    finally:
        for lg in loggers:
            lg.removeHandler(breaks)
        torch._logging.set_logs()
        torch._dynamo.reset()
        torch.set_num_threads(threads)


class _Runs(dict):
    """The compiled runs, each made on first use and kept: a ``-k`` selection compiles only the runs it reads."""

    def __init__(self, runtime: Any) -> None:
        super().__init__()
        self.runtime = runtime

    def __missing__(self, key: tuple[str, str]) -> CompiledRun:
        self[key] = _compiled_run(self.runtime, *key)
        return self[key]


@pytest.fixture(scope="module")
def compiled(runtime) -> _Runs:
    return _Runs(runtime)


def test_compiled_fast_tier_is_within_its_gates(compiled):
    """The fast tier acts inside regionally compiled blocks, within its gates of compiled stock."""
    stock, fast = compiled[("regional", "none")], compiled[("regional", FAST)]
    ssim_min, psnr_min = FAST_TIER_GATES
    for a, b in zip(stock.images, fast.images, strict=True):
        m = compare_images(a, b)
        assert m["ssim"] >= ssim_min and m["psnr"] >= psnr_min, m
    assert {"fast_modulate", "fast_residual"} <= set(fast.status["acting_on_pipeline"])
    # it ran in the compiled blocks: the affine layer norm and addcmul fold ops, so dynamo captured fewer (the pixels
    # may equal the default stack's: inductor decomposes both back into the same math)
    default = compiled[("regional", "default")]
    assert fast.captured < default.captured, (fast.captured, default.captured)


@pytest.mark.parametrize("granularity, spec", RUNS)
def test_repeated_requests_are_identical_and_compile_once(compiled, granularity, spec):
    run = compiled[(granularity, spec)]
    assert all(torch.equal(run.images[0], x) for x in run.images[1:])
    assert run.frames[0] > 0 and run.frames[-1] == run.frames[0], run.frames  # no recompile after request 1
    assert not run.hit_recompile_limit


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_compiled_default_is_pixel_identical_to_stock_without_graph_breaks_and_fewer_ops(compiled, granularity):
    """Ops counted from the first request's compiled graphs: captured by dynamo, inductor's IR nodes before fusion
    and its kernels. Under full compile the graph is stock's: nothing of the default stack acts inside it."""
    stock, default = compiled[(granularity, "none")], compiled[(granularity, "default")]
    for a, b in zip(stock.images, default.images, strict=True):
        assert a.abs().sum() > 0
        assert (to_uint8(a) == to_uint8(b)).all()
    assert default.graph_breaks == stock.graph_breaks
    assert default.frames[0] == stock.frames[0]  # the same graphs: nothing of the plugin splits them
    for run in [default] + ([compiled[(granularity, FAST)]] if (granularity, FAST) in RUNS else []):
        assert not [s for s in run.break_sites if "vllm_omni_ascend_opt" in s], run.break_sites
    if granularity == "full":  # the log is read: stock's own data-dependent branch (the text mask) is located
        assert any("qwen_image_transformer.py" in s for s in stock.break_sites), stock.break_sites
        assert (default.captured, default.ir_nodes, default.kernels) == (stock.captured, stock.ir_nodes, stock.kernels)
    else:
        assert default.ir_nodes < stock.ir_nodes and default.kernels < stock.kernels, (default, stock)
        assert default.captured < stock.captured


def test_regional_compile_hoists_value_keyed_work_and_status_says_what_acts(compiled):
    """Regional: the memo lookups and RoPE tables ran in eager pre-hooks and reached the compiled blocks as ready
    tensors. Full: nothing is hoisted, and the status says the value-keyed work has no eager place to run."""
    regional, full = compiled[("regional", "default")], compiled[("full", "default")]
    assert regional.hoisted == {"modulation": True, "rope": True} and regional.memo_hits > 0
    assert full.hoisted == {"modulation": False, "rope": False} and full.memo_hits == 0
    assert regional.status["compiled_regions"] == ["block"]
    assert full.status["compiled_regions"] == ["block", "transformer"]
    assert {"shared_modulation", "rope", "joint_attention", "vae_exact"} <= set(regional.status["acting_on_pipeline"])
    assert "vae_exact" in full.status["acting_on_pipeline"]
    for name in ("shared_modulation", "rope", "joint_attention"):
        assert "torch.compile runs the whole transformer" in full.reasons[name][0], full.reasons


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_status_of_a_compiled_transformer_without_inductor(runtime, granularity):
    """The same status facts on a transformer compiled as vLLM-Omni's runner does, with dynamo's eager backend
    (cheap: nothing compiles until it runs); the status is read from the model alone."""
    from vllm_omni.diffusion.compile import regionally_compile

    from vllm_omni_ascend_opt.blocks.upstream import guards

    api.select("default")
    tr = build(runtime)
    api.select("default", model=tr)
    assert guards.compiled_regions(tr) == frozenset()
    assert _report.explain(registry.get("joint_attention"), tr) == []
    if granularity == "full":
        tr.compile(backend="eager")
        assert guards.compiled_regions(tr) == {"block", "transformer"}
        acting = set()  # no eager place for value-keyed work
    else:
        regionally_compile(tr, backend="eager")
        assert guards.compiled_regions(tr) == {"block"}
        acting = {"shared_modulation", "rope", "joint_attention"}  # hoisted into the compiled blocks
    for name in ("shared_modulation", "rope", "joint_attention"):
        reasons = _report.explain(registry.get(name), tr)
        assert (reasons == []) is (name in acting), (name, reasons)
        assert name in acting or "torch.compile runs" in reasons[0], (name, reasons)
