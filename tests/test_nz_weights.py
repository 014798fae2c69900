"""`nz_weights`: FRACTAL_NZ casts of the transformer's fp16/bf16 linear weights, every skip reason, and the revert.

NPU paths run through the torch_npu fake (the NPU format is a tag on the storage, tests/fake_torch_npu/formats.py);
destructive cases load their own pipeline.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.fake_torch_npu import formats
from tests.harness.forward import tiny_forward
from vllm_omni_ascend_opt import _backend, api
from vllm_omni_ascend_opt.blocks.kernels import nz_check
from vllm_omni_ascend_opt.opts import nz_weights as nz
from vllm_omni_ascend_opt.opts import shared_modulation
from vllm_omni_ascend_opt.testbed.pipeline import load_pipeline

OPT = nz.OPT
#: The tiny transformer's linear layers: time embedding (2), img_in, txt_in, per block img_mod, to_qkv, add_kv_proj,
#: to_add_out, to_out, img_mlp (2), txt_mod, txt_mlp (2) = 10, norm_out.linear, proj_out.
N_LINEARS = 4 + 2 * 10 + 2


@pytest.fixture(scope="module")
def bf16_pipe(runtime):
    return load_pipeline(runtime, dtype=torch.bfloat16)


def _attach_once(pipe) -> tuple[dict, list[str]]:
    """Attach, read the report and the reasons, detach."""
    OPT.attach(pipe)
    out = OPT.report(pipe), OPT.reasons_inactive(pipe)
    OPT.detach(pipe)
    return out


def _linear_names(tr) -> list[str]:
    from vllm.model_executor.layers.linear import LinearBase

    return [n for n, m in tr.named_modules() if isinstance(m, (LinearBase, torch.nn.Linear))]


# ----- exactly the right layers, Parameters kept, reverted ------------------------------------------------------------
def test_casts_exactly_the_transformer_linears_and_reverts_and_skips_float32(fake_npu, bf16_pipe, runtime, tiny_pipe):
    fake = fake_npu()
    tr = bf16_pipe.transformer
    names = _linear_names(tr)
    assert len(names) == N_LINEARS
    weights = {n: tr.get_submodule(n).weight for n in names}
    before = {n: w.detach().clone() for n, w in weights.items()}
    others = {id(p): p.data_ptr() for m in (bf16_pipe.vae, bf16_pipe.text_encoder) for p in m.parameters()}
    nonlinear = {id(p): p.data_ptr() for p in tr.parameters()}
    ref = tiny_forward(runtime, tr)
    assert api.select("none,+nz_weights", model=bf16_pipe) == ["nz_weights"]
    report = OPT.report(bf16_pipe)
    assert sorted(report["cast"]) == sorted(f"transformer.{n}" for n in names) and report["skipped"] == {}
    assert OPT.reasons_inactive(bf16_pipe) == []
    for n, w in weights.items():
        layer = tr.get_submodule(n)
        assert layer.weight is w and type(w).__name__ == "ModelWeightParameter" and hasattr(w, "weight_loader")
        assert fake.get_npu_format(w) == formats.FRACTAL_NZ and torch.equal(w, before[n])
    linear_ids = {id(w) for w in weights.values()}
    assert all(p.data_ptr() == nonlinear[id(p)] for p in tr.parameters() if id(p) not in linear_ids)
    assert {id(p): p.data_ptr() for m in (bf16_pipe.vae, bf16_pipe.text_encoder) for p in m.parameters()} == others
    assert torch.equal(tiny_forward(runtime, tr), ref)  # the fake's NZ holds the same values (the device: "close")
    assert fake.calls["npu_format_cast"] == N_LINEARS
    api.select("none", model=bf16_pipe)
    for n, w in weights.items():
        assert tr.get_submodule(n).weight is w and fake.get_npu_format(w) == formats.ND and torch.equal(w, before[n])
    assert fake.calls["npu_format_cast"] == 2 * N_LINEARS
    report, reasons = _attach_once(tiny_pipe)
    assert report == {"cast": [], "skipped": {"dtype float32": N_LINEARS}}
    assert any("no linear weight was cast" in r and "dtype float32" in r for r in reasons)


# ----- every skip reason is reachable ---------------------------------------------------------------------------------
def test_loader_hook_casts_through_the_write_only_config_and_vllm_ascend_linear_method(fake_npu, runtime):
    """The plugin attaches to what DiffusersPipelineLoader.load_model returns (after its weight post-processing);
    torch.npu.config cannot be read back, and vllm-ascend's ``AscendUnquantizedLinearMethod`` subclasses vLLM's
    ``UnquantizedLinearMethod``: nz_weights still acts."""
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    fake = fake_npu()
    torch.npu.config.allow_internal_format = True  # what vLLM-Omni's NPU platform does in set_device
    with pytest.raises(AttributeError):
        torch.npu.config.allow_internal_format  # noqa: B018 - write-only, like the real _npuConfig
    api.select("none,+nz_weights")
    pipe = load_pipeline(runtime, dtype=torch.bfloat16)
    assert OPT.is_attached(pipe) and len(OPT.report(pipe)["cast"]) == N_LINEARS
    assert fake.get_npu_format(pipe.transformer.proj_out.weight) == formats.FRACTAL_NZ
    api.select("none", model=pipe)
    assert fake.get_npu_format(pipe.transformer.proj_out.weight) == formats.ND
    ascend_method = type("AscendUnquantizedLinearMethod", (UnquantizedLinearMethod,), {})
    layers = [m for m in pipe.transformer.modules() if isinstance(m, LinearBase)]
    assert layers and all(type(m.quant_method) is UnquantizedLinearMethod for m in layers)
    for m in layers:
        m.quant_method = ascend_method()
    casts = fake.calls["npu_format_cast"]
    report, reasons = _attach_once(pipe)
    assert len(report["cast"]) == N_LINEARS and report["skipped"] == {} and reasons == []
    assert fake.calls["npu_format_cast"] - casts == 2 * N_LINEARS  # the trial cast is the first layer's cast


def test_no_cast_without_internal_formats_read_at_each_attach_or_when_the_cast_does_not_take(fake_npu, bf16_pipe):
    fake = fake_npu(allow_internal_format=False)  # the A3 default [OP-AIF]
    ptr = bf16_pipe.transformer.proj_out.weight.data_ptr()
    report, reasons = _attach_once(bf16_pipe)
    assert report == {"cast": [], "skipped": {}} and bf16_pipe.transformer.proj_out.weight.data_ptr() == ptr
    assert any("trial npu_format_cast" in r and "internal formats not allowed" in r for r in reasons), reasons
    with pytest.raises(formats.FakeNpuError, match="OP-AIF"):  # what the trial cast found out
        fake.npu_format_cast(bf16_pipe.transformer.proj_out.weight.data, formats.FRACTAL_NZ)
    torch.npu.config.allow_internal_format = True  # the device option, not a cached read
    on, _ = _attach_once(bf16_pipe)
    assert len(on["cast"]) == N_LINEARS
    torch.npu.config.allow_internal_format = False
    off, reasons = _attach_once(bf16_pipe)
    assert off["cast"] == [] and any("internal formats not allowed" in r for r in reasons), reasons
    fake_npu(format_cast="keeps_nd")  # a cast that does not take is undone
    ptr = bf16_pipe.transformer.proj_out.weight.data_ptr()
    report, reasons = _attach_once(bf16_pipe)
    assert report == {"cast": [], "skipped": {}} and bf16_pipe.transformer.proj_out.weight.data_ptr() == ptr
    assert any("gave format 2: internal formats not allowed" in r for r in reasons), reasons


@pytest.mark.parametrize(
    ("cann", "needle"),
    [
        ("8.2.RC1", "CANN 8.2.RC1 < 8.3"),
        ("7.0.0", "CANN 7.0.0 < 8.3"),
        ("unknown", "CANN version unknown"),
        ("8.3.RC1", None),
        ("8.5.0", None),
    ],
)
def test_cann_versions_without_weightnz_routing_stay_off_with_the_versions(fake_npu, bf16_pipe, cann, needle):
    fake_npu(cann_version=cann)
    report, reasons = _attach_once(bf16_pipe)
    if needle is None:  # WeightNZ routing: no version reason
        assert OPT.reasons_inactive() == [] and len(report["cast"]) == N_LINEARS
        return
    assert report["cast"] == []
    assert any(needle in r and "torch_npu 2.13.0+fake" in r for r in OPT.reasons_inactive())
    assert any(needle in r for r in reasons)


@pytest.mark.parametrize(("route", "case"), [("aten::addmm", "3-D addmm with bias"), ("aten::mm", "without bias")])
def test_numbers_are_verified_at_first_use_for_both_routes(fake_npu, bf16_pipe, route, case):
    """An NZ route that reads the fractal layout as ND (old op-plugin/CANN) is caught for the biased 3-D addmm and
    for the bias-free matmul separately; nothing is cast and the reason names the failing case."""
    fake_npu()
    ptr = bf16_pipe.transformer.proj_out.weight.data_ptr()
    with formats.nz_route_ignores_format(route):
        report, reasons = _attach_once(bf16_pipe)
    assert report["cast"] == [] and bf16_pipe.transformer.proj_out.weight.data_ptr() == ptr
    assert any(
        "FRACTAL_NZ linear at" in r and "refused" in r and case in r and "differs from the ND weight" in r
        for r in reasons
    )
    assert any("refused" in r for r in OPT.reasons_inactive())  # cached per (device, dtype), shown by `list`


def test_memos_are_invalidated_and_the_numeric_check_is_cached_until_uninstall_clears_it(
    fake_npu, bf16_pipe, monkeypatch
):
    """Cast and revert invalidate the weight memos; the (device, dtype) verdict serves the next attach; uninstall
    drops it (same backend probe)."""
    fake_npu()
    invalidated = []
    w = bf16_pipe.transformer.proj_out.weight
    version = w._version
    # the registry's weights-changed event reaches shared_modulation, which drops its memo
    monkeypatch.setattr(shared_modulation.OPT, "invalidate", lambda: invalidated.append(1))
    OPT.attach(bf16_pipe)
    assert invalidated == [1] and w._version == version  # why the event is needed: .data swaps bump nothing
    OPT.detach(bf16_pipe)
    assert invalidated == [1, 1]
    (verdict,) = OPT.verdicts()
    assert verdict.ok and "3-D addmm with bias" in verdict.reason and "3-D matmul without bias" in verdict.reason
    calls = []
    orig = nz_check.check_nz_linear
    monkeypatch.setattr(nz_check, "check_nz_linear", lambda *a: calls.append(1) or orig(*a))
    OPT.attach(bf16_pipe)
    OPT.detach(bf16_pipe)
    assert calls == [] and any("verified" in n for n in OPT.notes())
    probe = _backend.probe_id()
    OPT.uninstall()
    assert _backend.probe_id() == probe and OPT.verdicts() == []


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ({"enable_layerwise_offload": True}, "CPU offload of the DiT is configured (layer_wise)"),
        ({"enable_cpu_offload": True}, "CPU offload of the DiT is configured (model_level)"),
        ({"lora_path": "/loras/style"}, "runtime LoRA is configured"),
        ("hsdp", "HSDP is on"),
        ("distilled", None),  # a distilled LoRA fused at load does not block
    ],
)
def test_skip_model_level_configurations(fake_npu, runtime, override, needle):
    from vllm_omni.diffusion.lora.manager import LoRABackend

    fake_npu()
    pipe = load_pipeline(runtime, dtype=torch.bfloat16)
    cfg = copy.copy(pipe.od_config)
    cfg.__dict__.pop("_resolved_diffusion_offload", None)  # resolve_offload caches its answer on the config
    if override == "hsdp":
        cfg.parallel_config = copy.copy(cfg.parallel_config)
        cfg.parallel_config.use_hsdp = True
    elif override == "distilled":
        cfg.lora_path, cfg.lora_backend = "/loras/distilled", LoRABackend.DISTILL
    else:
        for k, v in override.items():
            setattr(cfg, k, v)
    pipe.od_config = cfg
    report, reasons = _attach_once(pipe)
    if needle is None:
        assert len(report["cast"]) == N_LINEARS, reasons
    else:
        assert report["cast"] == [] and any(needle in r for r in reasons), reasons


def test_skip_per_layer_reasons(fake_npu, runtime):
    """One fresh model, one layer (or block) per reason; everything else is cast."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    from vllm.lora.layers import ReplicatedLinearWithLoRA
    from vllm_omni.diffusion.hooks.base import HookRegistry, ModelHook

    fake = fake_npu(allow_internal_format=True)
    pipe = load_pipeline(runtime, dtype=torch.bfloat16)
    tr = pipe.transformer
    b0, b1 = tr.transformer_blocks
    # host memory (CPU / layerwise offload left it there): all of block 1's weights
    for p in b1.parameters():
        formats.mark_host(p)
    # a live layerwise-offload hook on block 0 (vLLM-Omni's HookRegistry, hook name as LayerwiseOffloadHook's)
    HookRegistry.get_or_create(b0).register_hook("layerwise_offload", ModelHook())
    # runtime LoRA wrapper around proj_out (vLLM's own LoRA layer)
    tr.proj_out = ReplicatedLinearWithLoRA(tr.proj_out)
    # a DTensor (HSDP/FSDP2) weight
    mesh = init_device_mesh("cpu", (1,))
    w = tr.norm_out.linear.weight
    tr.norm_out.linear.weight = torch.nn.Parameter(DTensor.from_local(w.data, mesh, [Replicate()]), False)
    # n == 1 (out_features 1) and k == 1 (in_features 1) [VA-10287]
    te = tr.time_text_embed.timestep_embedder
    te.linear_1.weight = torch.nn.Parameter(te.linear_1.weight.data[:1].clone(), False)
    te.linear_2.weight = torch.nn.Parameter(te.linear_2.weight.data[:, :1].clone(), False)
    # a quantized layer (its quant method owns the layout)
    tr.txt_in.quant_method = type("Fp8LinearMethod", (), {})()
    # a weight already in an internal format
    tr.img_in.weight.data = fake.npu_format_cast(tr.img_in.weight.data, 29)
    report, reasons = _attach_once(pipe)
    assert report["skipped"] == {
        nz.SKIP_OFFLOAD_HOOK: 10,
        nz.SKIP_NOT_NPU: 10,
        nz.SKIP_LORA: 1,
        nz.SKIP_DTENSOR: 1,
        nz.SKIP_NARROW: 2,
        nz.SKIP_QUANTIZED: 1,
        "already in format 29": 1,
    }
    assert report["cast"] == []  # every linear of the tiny model fell into one of the reasons
    assert any("no linear weight was cast" in r and nz.SKIP_NARROW in r for r in reasons)


def test_fake_nz_matmul_rejects_narrow_weights_and_format_cast_returns_its_input(fake_npu):
    """Why n == 1 / k == 1 is skipped: the NZ matmul rejects it on the device (modelled by the fake). The real cast
    returns ``self`` when it already has the format (no copy)."""
    fake = fake_npu()
    x = torch.randn(3, 64).bfloat16()
    for shape in ((1, 64), (64, 1)):
        w = fake.npu_format_cast(torch.randn(shape).bfloat16(), formats.FRACTAL_NZ)
        with formats.nz_matmul_check(), pytest.raises(formats.FakeNpuError, match="VA-10287"):
            torch.nn.functional.linear(x if shape[1] == 64 else x[:, :1], w)
    ok = fake.npu_format_cast(torch.randn(8, 64).bfloat16(), formats.FRACTAL_NZ)
    with formats.nz_matmul_check():
        torch.nn.functional.linear(x, ok)
    assert fake.npu_format_cast(x, formats.ND) is x
    nzx = fake.npu_format_cast(x, formats.FRACTAL_NZ)
    assert nzx is not x and fake.npu_format_cast(nzx, formats.FRACTAL_NZ) is nzx
    with pytest.raises(TypeError):
        fake.npu_format_cast(x, formats.FRACTAL_NZ, 1)  # customize_dtype is keyword-only [TNPU-YAML]


@pytest.mark.parametrize("kind", ["oom", "runtime"])
def test_a_cast_that_faults_part_way_is_rolled_back_and_the_next_attach_casts_all(fake_npu, bf16_pipe, runtime, kind):
    """All or nothing: after a cast fails part-way every weight goes back to ND, status says why, and the next attach
    casts them all."""
    fake = fake_npu()
    tr = bf16_pipe.transformer
    weights = {n: tr.get_submodule(n).weight for n in _linear_names(tr)}
    before = {n: w.detach().clone() for n, w in weights.items()}
    ref = tiny_forward(runtime, tr)
    fake.faults.inject("npu_format_cast", at=4, kind=kind)  # the 4th cast: 3 weights are NZ by then
    assert api.select("none,+nz_weights", model=bf16_pipe) == ["nz_weights"]
    assert fake.faults.fired == {"npu_format_cast": 1}
    for n, w in weights.items():
        assert tr.get_submodule(n).weight is w and fake.get_npu_format(w) == formats.ND and torch.equal(w, before[n])
    (why,) = OPT.reasons_inactive(bf16_pipe)
    assert "failed after 3 weight(s)" in why and "restored to ND" in why and "fake fault" in why
    assert OPT.report(bf16_pipe)["cast"] == [] and torch.equal(tiny_forward(runtime, tr), ref)
    api.select("none", model=bf16_pipe)
    api.select("none,+nz_weights", model=bf16_pipe)  # the next attach: everything cast
    assert OPT.reasons_inactive(bf16_pipe) == [] and len(OPT.report(bf16_pipe)["cast"]) == N_LINEARS
    # the check includes one GEMM at production rows on the model's own weight shape
    (verdict,) = OPT.path.firsts.values()
    assert verdict.ok and "4096 rows with bias" in verdict.reason and "(weight " in verdict.reason
    api.select("none", model=bf16_pipe)
    assert all(fake.get_npu_format(w) == formats.ND for w in weights.values())
