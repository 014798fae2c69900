"""The torch_npu fake against the pinned torch-npu wheel, read, never installed (``fake_torch_npu/reference.py``):
signatures equal the codegen schemas, output shapes and dtypes the meta functions', ``torch.npu.config`` is
write-only like the real one. Skips with the reason when the wheel cannot be fetched."""

from __future__ import annotations

import inspect

import pytest
import torch

from tests.fake_torch_npu import KERNELS, build, formats, reference

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def wheel():
    path, why = reference.fetch()
    if path is None:
        pytest.skip(f"the torch-npu {reference.VERSION} wheel is not available: {why}")
    return path


def _variants() -> list[tuple[str, str, object]]:
    return [(k, v, fn) for k, impls in sorted(KERNELS.items()) for v, fn in sorted(impls.items())]


def _schema_signature(schema: reference.Schema) -> list[tuple[str, str, object]]:
    out = []
    for a in schema.args:
        kind = "kw" if a.kw_only else "pos"
        out.append((a.name, kind, "<required>" if a.default is reference._NO_DEFAULT else a.default))
    return out


def _fake_signature(fn) -> list[tuple[str, str, object]]:
    out = []
    for p in inspect.signature(fn).parameters.values():
        assert p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD), f"{fn.__name__}: *args/**kwargs hide the schema"
        kind = "kw" if p.kind is p.KEYWORD_ONLY else "pos"
        out.append((p.name, kind, "<required>" if p.default is p.empty else p.default))
    return out


@pytest.mark.parametrize(("kernel", "variant", "fn"), _variants(), ids=[f"{k}-{v}" for k, v, _ in _variants()])
def test_fake_signatures_equal_the_real_schemas(wheel, kernel, variant, fn):
    schema = reference.schemas()[kernel]
    if getattr(fn, "legacy_signature", None):
        pytest.skip(f"{kernel}/{variant} models an older release's signature {fn.legacy_signature} on purpose")
    assert _fake_signature(fn) == _schema_signature(schema), schema.text


def test_installed_fake_ops_keep_the_schema_signature_and_reject_unknown_keywords(wheel):
    mod = build()
    for kernel in KERNELS:
        assert _fake_signature(getattr(mod, kernel)) == _schema_signature(reference.schemas()[kernel])
    x = torch.randn(1, 4, 1, 8)
    r = torch.ones(1, 4, 1, 8)
    mod.npu_rotary_mul(self=x, r1=r, r2=r * 0, rotary_mode="interleave")  # torch.ops.npu keyword names
    with pytest.raises(TypeError):
        mod.npu_rotary_mul(input=x, r1=r, r2=r)  # the old fake's name: not the schema's
    with pytest.raises(TypeError):
        mod.npu_format_cast(torch.randn(4, 4), 29, None)  # customize_dtype is keyword-only


def _cases():
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype)

    def i8(*shape):
        return torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)

    cos = torch.rand(1, 6, 1, 64, generator=g).bfloat16()
    half_r = torch.rand(1, 1, 6, 32, generator=g).half()
    mask = torch.zeros(2, 1, 12, 12, dtype=torch.bool)
    mask[1, :, :, -3:] = True
    return [
        ("npu_rotary_mul", "interleave BSND", (rnd(2, 6, 3, 64), cos, cos), {"rotary_mode": "interleave"}),
        ("npu_rotary_mul", "half BNSD", (rnd(2, 3, 6, 32, dtype=torch.float16), half_r, half_r), {}),
        (
            "npu_fusion_attention",
            "BSND masked",
            (rnd(2, 12, 4, 64), rnd(2, 12, 4, 64), rnd(2, 12, 4, 64), 4, "BSND"),
            {"atten_mask": mask, "scale": 0.125},
        ),
        ("npu_fusion_attention", "BNSD GQA", (rnd(1, 4, 10, 32), rnd(1, 2, 10, 32), rnd(1, 2, 10, 32), 4, "BNSD"), {}),
        ("npu_fusion_attention", "BSH", (rnd(2, 9, 128), rnd(2, 9, 128), rnd(2, 9, 128), 2, "BSH"), {}),
        ("npu_fusion_attention", "SBH", (rnd(9, 2, 128), rnd(9, 2, 128), rnd(9, 2, 128), 2, "SBH"), {}),
        (
            "npu_fused_infer_attention_score",
            "BNSD",
            (rnd(1, 4, 10, 64), rnd(1, 4, 10, 64), rnd(1, 4, 10, 64)),
            {"num_heads": 4, "input_layout": "BNSD", "scale": 0.125},
        ),
        ("npu_layer_norm_eval", "3-D", (rnd(2, 5, 16), [16]), {"eps": 1e-6}),
        ("npu_rms_norm", "BSND bf16", (rnd(2, 6, 3, 64), rnd(64)), {"epsilon": 1e-6}),
        ("npu_rms_norm", "2-D gamma fp32", (rnd(4, 5, 16, dtype=torch.float32), rnd(5, 16, dtype=torch.float32)), {}),
        ("npu_dynamic_quant", "2-D bf16 per token", (rnd(6, 32),), {}),
        ("npu_dynamic_quant", "3-D fp16 per token", (rnd(2, 6, 32, dtype=torch.float16),), {}),
        (
            "npu_quant_matmul",
            "int8 x int8, bf16 out, per-token scale, bias",
            (i8(6, 32), i8(32, 48), rnd(48, dtype=torch.float32)),
            {"pertoken_scale": rnd(6, dtype=torch.float32).abs(), "bias": rnd(48), "output_dtype": 15},
        ),
    ]


def _meta(x):
    return x.to("meta") if isinstance(x, torch.Tensor) else x


def _describe(out) -> list[object]:
    outs = out if isinstance(out, tuple) else (out,)
    return [(tuple(o.shape), o.dtype) if isinstance(o, torch.Tensor) else type(o).__name__ for o in outs]


@pytest.mark.parametrize(("kernel", "case", "args", "kwargs"), _cases(), ids=[f"{c[0]}-{c[1]}" for c in _cases()])
def test_fake_outputs_match_the_real_meta_functions(wheel, fake_npu, kernel, case, args, kwargs):
    fake = fake_npu()
    got = getattr(fake, kernel)(*args, **kwargs)
    meta = reference.meta_functions()[kernel]
    # The dispatcher passes positional arguments by position (the meta functions name them differently), kw-only by name
    bound = inspect.signature(getattr(fake, kernel)).bind(*args, **kwargs)
    bound.apply_defaults()
    params = inspect.signature(getattr(fake, kernel)).parameters
    pos = [_meta(v) for n, v in bound.arguments.items() if params[n].kind is not params[n].KEYWORD_ONLY]
    kw = {n: _meta(v) for n, v in bound.arguments.items() if params[n].kind is params[n].KEYWORD_ONLY}
    want = meta(*pos, **kw)
    assert _describe(got) == _describe(want)
    assert len(got if isinstance(got, tuple) else (got,)) == len(reference.schemas()[kernel].returns)


def test_format_cast_matches_the_real_meta_and_schema(wheel, fake_npu):
    fake = fake_npu()
    x = torch.randn(32, 48).bfloat16()
    nz = fake.npu_format_cast(x, formats.FRACTAL_NZ)
    want = reference.meta_functions()["_npu_format_cast"](x.to("meta"), formats.FRACTAL_NZ)  # what it dispatches to
    assert _describe(nz) == _describe(want)
    assert reference.schemas()["npu_format_cast"].returns == ("Tensor",)
    assert reference.schemas()["get_npu_format"].returns == ("int",) and isinstance(fake.get_npu_format(nz), int)


def _script(cfg, options) -> list[object]:
    """The same operations on a config object; what each does (result or exception type) and the option store."""
    trace: list[object] = []
    for value in (True, False, 1, 0):
        cfg.allow_internal_format = value
        trace.append(options())
        try:
            trace.append(("read", cfg.allow_internal_format))
        except AttributeError:
            trace.append(("read", "AttributeError"))
    cfg.some_other_option = True
    trace.append(options())
    trace.append(("hasattr", hasattr(cfg, "some_other_option"), hasattr(cfg, "allow_internal_format")))
    return trace


def test_fake_config_behaves_like_the_real_npuconfig(wheel):
    real, stubs = reference.real_npu_config()
    fake = build(allow_internal_format=True)
    real_trace = _script(real, lambda: dict(stubs.options))
    fake_trace = _script(fake.npu.config, lambda: {"ALLOW_INTERNAL_FORMAT": fake._C.options["ALLOW_INTERNAL_FORMAT"]})
    assert fake_trace == real_trace
    assert ("read", "AttributeError") in real_trace  # the finding: the attribute is write-only
    assert stubs._get_option("ALLOW_INTERNAL_FORMAT") == fake._C._npu_getOption("ALLOW_INTERNAL_FORMAT") == b"disable"
    real.allow_internal_format = True  # reading it back gives nothing: why nz_weights must not read it
    assert getattr(real, "allow_internal_format", None) is None


def test_timing_plan_prices_quant_matmul_by_the_schema_weight_argument(wheel, fake_npu):
    """The weight is the schema's ``x2`` (2nd positional): ND 1 ms, NZ 0.5 ms; ``by_weight_format`` sets both."""
    arg = reference.schemas()["npu_quant_matmul"].args[1]
    assert (arg.name, arg.kw_only) == ("x2", False)
    npu = fake_npu(timed=True)
    q, s = npu.npu_dynamic_quant(torch.randn(4, 16).to(torch.bfloat16))
    nd = torch.randint(-127, 128, (16, 8), dtype=torch.int8)
    nz, ws = npu.npu_format_cast(nd, formats.FRACTAL_NZ), torch.rand(8)

    def ms(w, keyword=False):
        t0 = npu.timing.clock
        args, kw = ((q,), {"x2": w, "scale": ws}) if keyword else ((q, w, ws), {})
        npu.npu_quant_matmul(*args, pertoken_scale=s, output_dtype=torch.bfloat16, **kw)
        return npu.timing.clock - t0

    assert (ms(nd), ms(nz)) == (1.0, 0.5)
    npu.timing.by_weight_format("npu_quant_matmul", 2.0, 1.5)
    assert (ms(nd), ms(nz), ms(nd, True), ms(nz, True)) == (2.0, 1.5, 2.0, 1.5)


def test_fake_rms_norm_computes_the_documented_result_and_enforces_its_constraints(fake_npu):
    """[OP-RMS]: y = x * rsqrt(mean(x^2) + eps) * gamma (fp32 inside, one rounding), rstd fp32, and the limits."""
    fake = fake_npu()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 3, 8, generator=g).bfloat16()
    w = torch.randn(8, generator=g).bfloat16()
    y, rstd = fake.npu_rms_norm(x, w, epsilon=1e-5)
    x32 = x.float()
    want_rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert rstd.dtype == torch.float32 and rstd.shape == (2, 5, 3, 1)
    torch.testing.assert_close(rstd, want_rstd, rtol=0, atol=0)
    assert y.dtype == torch.bfloat16 and torch.equal(y, (x32 * want_rstd * w.float()).bfloat16())
    assert torch.equal(y, torch.nn.functional.rms_norm(x, (8,), w, 1e-5))  # torch 2.13's composite, bitwise
    bad = [
        (x.double(), w.double()),  # dtype
        (x, w.float()),  # gamma dtype != self dtype
        (x[0, 0, 0], w),  # 1-D self
        (x, torch.randn(4).bfloat16()),  # gamma not the trailing dims
        (x.reshape(1, 1, 1, 1, 1, 1, 1, 1, 30, 8), w),  # 10-D self
    ]
    for a, b in bad:
        with pytest.raises(RuntimeError, match="OP-RMS"):
            fake.npu_rms_norm(a, b)
    assert fake.calls["npu_rms_norm"] == 1 + len(bad)
