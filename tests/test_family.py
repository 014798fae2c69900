"""The Qwen-Image family of vLLM-Omni 0.30 (DMD2, Edit, Edit-Plus 2509 and 2511 ``zero_cond_t``, Layered), each a
tiny model loaded through vLLM-Omni's loader and run through its real pipeline (one load and one set of ``none``
reference images per pipeline): the default stack gives ``none``'s images bitwise over CFG on/off, seeds,
resolutions, a repeat and input images; every selected optimization acts or says why; ``vae_fast`` meets its gates.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from vllm_omni_ascend_opt import _plugin, _report, api
from vllm_omni_ascend_opt.ablation.metrics import compare_images, passes_gates
from vllm_omni_ascend_opt.blocks.memo.keys import modulation_linears
from vllm_omni_ascend_opt.opts import shared_modulation as sm
from vllm_omni_ascend_opt.testbed import TINY_FAMILY, build_model_dir
from vllm_omni_ascend_opt.testbed.pipeline import generate, load_pipeline, sample_image

FAMILY = ["dmd2", "edit", "edit-plus", "edit-2511", "layered"]
IMAGE_PIPELINES = {"edit", "edit-plus", "edit-2511", "layered"}
#: The exact optimizations on by default that act on every pipeline of the family on CPU.
EXACT_EVERYWHERE = {"shared_modulation", "rope", "joint_attention"}
TINY_LAYERS = TINY_FAMILY["edit"].num_layers
#: Pinned kernel-launching ops per block on a warm request, default stack (docs/results.md).
CPU_BLOCK_BUDGET = dict.fromkeys(FAMILY, 46)
NPU_BLOCK_BUDGET = dict.fromkeys(FAMILY, 40)


@dataclass(frozen=True)
class Req:
    seed: int
    height: int
    width: int
    cfg: float
    image: tuple[int, int, int] | None  # (seed, width, height) of the input image
    tag: str


#: Two seeds, two resolutions (output size; input image size for Layered, whose output follows its input),
#: CFG on and off, a repeated request and a request that differs from the first only by its input image.
REQUESTS = (
    Req(1, 32, 32, 1.0, (1, 32, 32), "base"),
    Req(2, 32, 32, 4.0, (1, 32, 32), "seed2-cfg"),
    Req(1, 32, 48, 4.0, (2, 48, 32), "wide-cfg"),
    Req(2, 32, 48, 1.0, (2, 48, 32), "wide-seed2"),
    Req(1, 32, 32, 1.0, (1, 32, 32), "base-repeated"),
    Req(1, 32, 32, 1.0, (3, 32, 32), "other-image"),
)


def _run(fam: SimpleNamespace, rt: Any, r: Req) -> torch.Tensor:
    kw: dict[str, Any] = {}
    if fam.key in IMAGE_PIPELINES:
        mode = "RGBA" if fam.key == "layered" else "RGB"
        kw["image"] = sample_image(r.image[0], width=r.image[1], height=r.image[2], mode=mode)
    if fam.key == "layered":
        kw["layers"] = 2
    return generate(
        fam.pipe, rt, "a red cat", height=r.height, width=r.width, steps=2, seed=r.seed, cfg_scale=r.cfg, **kw
    ).images


@pytest.fixture(scope="module", params=FAMILY)
def fam(request, runtime) -> SimpleNamespace:
    """One pipeline of the family, loaded once, with its ``none`` reference images."""
    _plugin._reset_for_tests()
    key = request.param
    pipe = load_pipeline(runtime, model=build_model_dir(TINY_FAMILY[key]))
    fam = SimpleNamespace(key=key, pipe=pipe)
    api.select("none", model=pipe)
    fam.refs = {r.tag: _run(fam, runtime, r) for r in REQUESTS}
    _plugin._reset_for_tests()
    return fam


def test_pipeline_class_inputs_default_stack_is_bitwise_none_and_each_optimization_acts_or_says_why(fam, runtime):
    """The intended pipeline class, references depending on what they should, and default gives them; ``list``/status
    and the per-model reasons: nothing selected is silently inactive on any pipeline; ``vae_fast`` meets its gates."""
    from vllm_omni.diffusion.models.qwen_image import pipeline_qwen_image_edit_plus as plus

    want = {
        "dmd2": "QwenImageDMD2Pipeline",
        "edit": "QwenImageEditPipeline",
        "edit-plus": "QwenImageEditPlusPipeline",
        "edit-2511": "QwenImageEditPlusPipeline",
        "layered": "QwenImageLayeredPipeline",
    }[fam.key]
    assert type(fam.pipe).__name__ == want
    assert fam.pipe.transformer.zero_cond_t is (fam.key == "edit-2511")
    if fam.key == "edit-2511":
        assert type(fam.pipe) is plus.QwenImageEditPlusPipeline
    refs = fam.refs
    assert torch.equal(refs["base"], refs["base-repeated"])  # deterministic
    assert not torch.equal(refs["base"], refs["seed2-cfg"])
    assert refs["wide-cfg"].shape[-1] != refs["base"].shape[-1]
    if fam.key in IMAGE_PIPELINES:
        assert not torch.equal(refs["base"], refs["other-image"])  # the input image reaches the output
    else:
        assert torch.equal(refs["base"], refs["other-image"])
    if fam.key == "layered":
        assert refs["base"].shape[:2] == (2, 4)  # 2 RGBA layers
    api.select("default", model=fam.pipe)
    sm.OPT.reset_stats()
    got = {r.tag: _run(fam, runtime, r) for r in REQUESTS}
    for tag, ref in fam.refs.items():
        assert torch.equal(got[tag], ref), (fam.key, tag)
    assert EXACT_EVERYWHERE <= set(_report.acting(fam.pipe)), _report.off_reasons(fam.pipe)
    assert sm.OPT.fallback_reasons() == {}  # every block ran the memoized path (two-segment ones included)
    assert sm.OPT.memo.stats["hits"] > 0
    if fam.key == "edit-2511":
        assert sm.OPT.memo.stats["plans"] > 0 and sm.OPT.memo.stats["zero_t_hits"] > 0
    api.select("default,+vae_fast", model=fam.pipe)
    acting, reasons = _report.acting(fam.pipe), _report.off_reasons(fam.pipe)
    assert all(isinstance(w, str) and w for why in reasons.values() for w in why), reasons
    layered = fam.key == "layered"
    for name in ("vae_exact", "vae_fast"):
        if layered:  # vLLM-Omni's own RGBA AutoencoderKLQwenImage, not diffusers' class the VAE patches target
            assert name not in acting and any("not diffusers' AutoencoderKLQwenImage" in w for w in reasons[name])
        else:
            assert name in acting, reasons.get(name)
    rows = {r["name"]: r for r in api.status()}
    for name in ("fused_attention", "nz_weights"):  # no torch_npu here: the environment reason is listed
        assert not rows[name]["active"] and rows[name]["reasons_inactive"]
    for r in (REQUESTS[0], REQUESTS[2]):
        got = _run(fam, runtime, r)
        ref = fam.refs[r.tag]
        if fam.key == "layered":
            assert torch.equal(got, ref)  # inactive on Layered (see above): stock VAE
            continue
        m = compare_images(ref, got)
        assert passes_gates(m), (fam.key, r.tag, m)


def test_dmd2_forward_as_shipped_raises():
    """Why the test bed runs DMD2's forward itself (``pipeline.run_forward``); once this passes, drop it."""
    from vllm_omni.diffusion.models.dmd2.mixin import DMD2PipelineMixin
    from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image import QwenImagePipeline

    class Probe(DMD2PipelineMixin, QwenImagePipeline):
        def __init__(self):  # no model: only the forward chain is exercised
            self.dmd2_config = SimpleNamespace(num_inference_steps=2, guidance_scale=1.0)

        def _sanitize_dmd2_request(self, req):
            pass

    with pytest.raises(TypeError, match="guidance_scale"):
        Probe().forward(SimpleNamespace())


# ----------------------------------------------------------------------------------------------------------------
# kernel-launching ops per block and per denoise step, modulation bytes per step (warm request)
# ----------------------------------------------------------------------------------------------------------------
#: The text-to-image block's reduction on this tiny model: every pipeline, the two-segment edit block too, reaches it.
T2I_REDUCTION = 106 - 46


def _warm_counts(fam: SimpleNamespace, rt: Any) -> dict[str, Any]:
    """Ops of the last block and of one forward (CFG off), modulation bytes read, on a warm request."""
    from vllm_omni_ascend_opt.testbed.opcount import TensorReadCounter, count_module_calls

    r = REQUESTS[0]
    _run(fam, rt, r)
    tr = fam.pipe.transformer
    mods = [p for lin in modulation_linears(tr) for p in lin.parameters()]
    with (
        count_module_calls(tr.transformer_blocks[-1]) as blocks,
        count_module_calls(tr) as steps,
        TensorReadCounter(mods) as reads,
    ):
        images = _run(fam, rt, r)
    assert len({c.total for c in blocks}) == 1 and len({c.total for c in steps}) == 1  # every step alike
    return dict(block=blocks[0].total, step=steps[0].total, mod_bytes=reads.bytes / len(steps), images=images)


@pytest.mark.parametrize("npu_paths", [False, True], ids=["cpu", "npu_paths"])
def test_ops_per_block_and_step(fam, runtime, fake_npu, npu_paths):
    """``npu_paths``: the torch_npu paths through the semantic fake (fp32: its kernels round like stock)."""
    npu = fake_npu() if npu_paths else None
    api.select("none", model=fam.pipe)
    stock = _warm_counts(fam, runtime)
    api.select("default", model=fam.pipe)
    opt = _warm_counts(fam, runtime)
    assert torch.equal(stock["images"], opt["images"])
    if npu_paths:
        assert npu.calls["npu_rotary_mul"] > 0
        assert opt["block"] <= NPU_BLOCK_BUDGET[fam.key], opt["block"]
        return
    assert stock["mod_bytes"] > 0 and opt["mod_bytes"] == 0
    assert stock["block"] - opt["block"] >= T2I_REDUCTION, (stock["block"], opt["block"])
    assert opt["block"] <= CPU_BLOCK_BUDGET[fam.key], opt["block"]
    assert stock["step"] - opt["step"] >= TINY_LAYERS * T2I_REDUCTION


@pytest.mark.multiproc
def test_edit_pipelines_under_ulysses_and_cfg_parallel():
    """``default`` is bitwise ``none`` on every rank (Ulysses: per-rank segment plans), over images and CFG; both edit
    pipelines in one spawn."""
    from tests.harness.parallel import Job, ModeRun, run_parallel_modes

    reqs = {
        "a": dict(height=32, width=32, seed=1, image=1),
        "b": dict(height=32, width=48, seed=2, image=2),
        "a-again": dict(height=32, width=32, seed=1, image=1),
    }
    jobs = tuple(
        Job(spec, steps=2, cfg_scale=4.0, tag=f"{spec}:{tag}", **kw)
        for spec in ("none", "default")
        for tag, kw in reqs.items()
    )
    variants = ("edit-2511", "edit-plus")
    plan = [
        ModeRun(mode, jobs, model_dir=str(build_model_dir(TINY_FAMILY[v])), tag=v)
        for v in variants
        for mode in ("ulysses", "cfg_parallel")
    ]
    runs = run_parallel_modes(plan, timeout_s=900.0)
    assert sorted(runs) == sorted(f"{v}:{m}" for v in variants for m in ("ulysses", "cfg_parallel"))
    # each run built its own model (edit-2511 is edit-plus with zero_cond_t): the spawn's runs did not share one
    assert not torch.equal(runs["edit-2511:ulysses"].images("none:a", 0), runs["edit-plus:ulysses"].images("none:a", 0))
    for key, run in runs.items():
        variant, mode = key.split(":")
        for rank in range(run.world_size):
            for tag in reqs:
                want = run.images(f"none:{tag}", rank)
                assert torch.equal(run.images(f"default:{tag}", rank), want), (variant, mode, rank, tag)
                assert torch.equal(want, run.images(f"none:{tag}", 0))  # every rank returns the image
            assert not torch.equal(run.images("none:a", rank), run.images("none:b", rank))
            for j in run.ranks[rank].jobs:
                if j.job.spec == "default":
                    assert EXACT_EVERYWHERE <= set(j.acting), (mode, j.reasons)
                    assert not j.fallbacks.get("shared_modulation"), (mode, j.fallbacks)
        hooks = set(run.ranks[0].sp_hooks)  # vLLM-Omni's _sp_plan hooks: the sequence really is split under Ulysses
        if mode == "ulysses":
            assert {"sp_input---image_rope_prepare", "sp_output---proj_out"} <= hooks, hooks
            assert any("modulate_index_prepare" in h for h in hooks), hooks
        else:
            assert hooks == set(), hooks
