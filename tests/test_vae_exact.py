"""vae_exact: bitwise-identical decodes (fp32 and bf16, several sizes), fewer ops, clean revert, fallbacks."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import AutoencoderKLQwenImage, QwenImageResidualBlock

from vllm_omni_ascend_opt import _backend, _plugin, api
from vllm_omni_ascend_opt.ablation.metrics import compare_images
from vllm_omni_ascend_opt.opts import vae_exact, vae_fast
from vllm_omni_ascend_opt.opts.vae_exact import OPT
from vllm_omni_ascend_opt.testbed.memory import measure
from vllm_omni_ascend_opt.testbed.opcount import count_ops
from vllm_omni_ascend_opt.testbed.pipeline import generate

# Non-trivial statistics (the tiny test-bed model uses mean 0 / std 1, which would hide a wrong cache).
MEAN = [0.31, -0.72, 1.13, 0.05]
STD = [2.8, 1.45, 0.61, 3.3]
# Latent sizes: square, non-square, odd.
SIZES = [(4, 4), (6, 10), (9, 7)]
DTYPES = [torch.float32, torch.bfloat16]


def make_dist_vae(dtype: torch.dtype = torch.float32, out_gain: float = 5.0, **kw) -> nn.Module:
    """vLLM-Omni's distributed VAE, seeded, small; ``out_gain`` scales conv_out so some pixels reach the clamp."""
    from vllm_omni.diffusion.distributed.autoencoders.autoencoder_kl_qwenimage import (
        DistributedAutoencoderKLQwenImage,
    )

    cfg = dict(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=2,
        temperal_downsample=[False, True, True],
        latents_mean=MEAN,
        latents_std=STD,
    )
    torch.manual_seed(0)
    vae = DistributedAutoencoderKLQwenImage(**{**cfg, **kw}).eval()
    with torch.no_grad():  # RMS-norm gammas start at 1: draw them too, so every op of the decoder matters
        for m in vae.modules():
            if hasattr(m, "gamma"):
                m.gamma.uniform_(0.5, 1.5)
        vae.decoder.conv_out.weight.mul_(out_gain)
        vae.decoder.conv_out.bias.mul_(out_gain)
    return vae.to(dtype)


def latent(h: int, w: int, dtype: torch.dtype, t: int = 1, z: int = 4, seed: int = 1) -> torch.Tensor:
    return torch.randn(1, z, t, h, w, generator=torch.Generator().manual_seed(seed)).to(dtype)


def decode(vae: nn.Module, z: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return vae.decode(z, return_dict=False)[0]


@contextlib.contextmanager
def decoder_calls(vae: nn.Module) -> Iterator[list[str]]:
    """Per decoder call, the path that ran: stock passes its feature cache, the single-frame decode does not."""
    log: list[str] = []

    def pre(_m, _args, kwargs):
        log.append("stock" if kwargs.get("feat_cache") is not None else "single_frame")

    h = vae.decoder.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        yield log
    finally:
        h.remove()


def patched_anywhere(pipe_or_vae) -> list[str]:
    own = {"_decode", "tiled_decode", "tile_exec", "clear_cache", "forward", "_decode_latents"}
    return [n for n, m in pipe_or_vae.named_modules() if own & set(vars(m))]


@pytest.fixture(scope="module")
def vaes(runtime):
    return {dt: make_dist_vae(dt) for dt in DTYPES}


# ----- bitwise --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_direct_vae_bitwise_several_sizes_fewer_ops_and_multi_frame_takes_stock_path(vaes, dtype):
    vae = vaes[dtype]
    zs = [latent(h, w, dtype, seed=i) for i, (h, w) in enumerate(SIZES)]
    z3 = latent(4, 6, dtype, t=3)
    with decoder_calls(vae) as stock_path:
        ref = [decode(vae, z) for z in zs]
    assert stock_path == ["stock"] * len(zs)
    _, stock = count_ops(lambda: decode(vae, zs[0]))
    ref3 = decode(vae, z3)
    api.select("none,+vae_exact", model=vae)
    assert OPT.piece_report(vae) == {
        "single_frame_decode": "",
        "single_frame_tiles": "",
        "cached_conv_counts": "",
        "upsample_native_dtype": "",
        "pointwise_conv_no_pad": "",
        "latents_stats_cache": "attached to a bare VAE (no pipeline _decode_latents)",
    }
    with decoder_calls(vae) as path:
        got = [decode(vae, z) for z in zs]
    assert path == ["single_frame"] * len(zs)  # the patched decode ran (no silent stock fallback)
    for r, g, (h, w) in zip(ref, got, SIZES, strict=True):
        assert g.shape == (1, 3, 1, 8 * h, 8 * w)
        assert 0 < (r.abs() == 1).float().mean() < 0.5  # the final clamp matters, but not everywhere
        assert g.dtype == dtype
        assert torch.equal(r, g), (h, w, (r.float() - g.float()).abs().max())
    assert not OPT.fallback_reasons()
    # The VAE is left in the same cache state as stock.
    assert vae._feat_map == [None] * vae._cached_conv_counts["decoder"] and vae._conv_idx == [0]
    _, ours = count_ops(lambda: decode(vae, zs[0]))  # warm: the native-dtype upsample was verified on a probe
    n_res = sum(isinstance(m, QwenImageResidualBlock) for m in vae.decoder.modules())
    # Stock clones conv inputs for a next frame that never comes; the one clone left is the attention's .contiguous().
    assert stock.counts["aten::clone"] - ours.counts["aten::clone"] == 2 * n_res + 2 == 30
    assert ours.counts["aten::clone"] == 1
    # 1x1x1 convs (post_quant_conv + one shortcut) no longer copy through a zero-width pad.
    assert stock.counts["aten::constant_pad_nd"] - ours.counts["aten::constant_pad_nd"] == 2
    if dtype == torch.bfloat16:  # 3 upsamples x (to fp32, back to bf16)
        assert stock.counts["aten::_to_copy"] - ours.counts["aten::_to_copy"] == 6
    assert ours.total < stock.total
    for op in ("aten::clone", "aten::constant_pad_nd", "aten::_to_copy"):
        del ours.counts[op], stock.counts[op]
    assert ours.counts == stock.counts  # everything else is the same computation
    got3 = decode(vae, z3)
    assert ref3.shape[2] == 9  # 1 + 4 * 2 frames: the feature cache and the time convs really ran
    assert torch.equal(ref3, got3)  # the submodule pieces stay exact with a cache and several frames
    assert any("multi-frame" in r for r in OPT.fallback_reasons())


def test_pipeline_bitwise_fp32(tiny_pipe, runtime):
    sizes = [(32, 32), (48, 64)]
    api.select("none", model=tiny_pipe)
    ref = [generate(tiny_pipe, runtime, height=h, width=w, steps=2, seed=3) for h, w in sizes]
    api.select("none,+vae_exact", model=tiny_pipe)
    assert all(v == "" for v in OPT.piece_report(tiny_pipe).values()), OPT.piece_report(tiny_pipe)
    with decoder_calls(tiny_pipe.vae) as path:
        got = [generate(tiny_pipe, runtime, height=h, width=w, steps=2, seed=3) for h, w in sizes]
    assert path == ["single_frame"] * len(sizes)
    for r, g in zip(ref, got, strict=True):
        assert torch.equal(r.images, g.images)
    assert not OPT.fallback_reasons()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_pipeline_decode_latents_bitwise_with_real_stats(tiny_pipe, runtime, dtype):
    """The pipeline-level piece (cached mean / 1/std) with non-trivial statistics, fp32 and bf16."""
    original_vae = tiny_pipe.vae
    arch = ("base_dim", "dim_mult", "num_res_blocks", "temperal_downsample")
    vae = make_dist_vae(dtype, **{k: original_vae.config[k] for k in arch})
    tiny_pipe.vae = vae
    try:
        z = vae.config.z_dim
        shapes = [(32, 32), (48, 64)]
        packed = [
            torch.randn(1, (h // 8) * (w // 8), 4 * z, generator=torch.Generator().manual_seed(h + w)) * 3
            for h, w in shapes
        ]

        def run():
            with runtime.context(), torch.no_grad():
                return [
                    tiny_pipe._decode_latents(p, h, w, "pt").output for p, (h, w) in zip(packed, shapes, strict=True)
                ]

        ref = run()
        api.select("none,+vae_exact", model=tiny_pipe)
        assert OPT.piece_report(tiny_pipe)["latents_stats_cache"] == ""
        with decoder_calls(vae) as path:
            got, again = run(), run()  # second call: from the cache
        assert path == ["single_frame"] * 2 * len(shapes)
        for r, g, a in zip(ref, got, again, strict=True):
            assert r.dtype == dtype
            assert torch.equal(r, g) and torch.equal(r, a)
    finally:
        api.select("none", model=tiny_pipe)
        tiny_pipe.vae = original_vae


def test_latents_stats_built_once_and_per_call_while_tracing(tiny_pipe, runtime, monkeypatch):
    """Stock builds the mean and std tensors every call, the pipeline piece once (per call again under tracing)."""
    packed = torch.randn(1, 4 * 4, 16, generator=torch.Generator().manual_seed(0))
    made = []
    real_tensor = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: made.append(1) or real_tensor(*a, **k))

    def run():
        with runtime.context(), torch.no_grad():
            return tiny_pipe._decode_latents(packed, 32, 32, "pt").output

    run()
    assert len(made) == 2  # stock: mean and std, every call
    api.select("none,+vae_exact", model=tiny_pipe)
    made.clear()
    run(), run(), run()
    assert len(made) == 2  # built once, reused
    made.clear()
    with monkeypatch.context() as m:
        m.setattr(torch.compiler, "is_compiling", lambda: True)
        run(), run()
    assert len(made) == 4  # stock: mean and std, every call
    made.clear()
    run(), run()
    assert made == []  # outside tracing: from the cache


# ----- fallbacks keep stock results -----------------------------------------------------------------------------------
@contextlib.contextmanager
def tiled(pipe: nn.Module, dtype: torch.dtype = torch.float32) -> Iterator[nn.Module]:
    """The pipeline's VAE in ``dtype``, tiled with ``TILES``; afterwards nothing selected, fp32 and untiled again."""
    vae = pipe.vae.to(dtype)
    names = [f"tile_sample_{k}_{d}" for k in ("min", "stride") for d in ("height", "width")]
    saved = {n: getattr(vae, n) for n in ("use_tiling", *names)}
    vae.enable_tiling(*TILES)
    try:
        yield vae
    finally:
        api.select("none", model=pipe)
        vae.to(torch.float32)
        for n, v in saved.items():
            setattr(vae, n, v)


def parallel_decode(vae: nn.Module, z: torch.Tensor) -> torch.Tensor:
    """vLLM-Omni's VAE patch parallelism (split / exec / merge), run on one rank."""
    with torch.no_grad():
        tasks, grid = vae.tile_split(z)
        return vae.tile_merge({t.grid_coord: vae.tile_exec(t) for t in tasks}, grid)


#: Tiles that really tile the tiny VAE (compression 4): 32 px tiles at a 24 px stride = 8-latent tiles every 6.
TILES = (32, 32, 24, 24)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_tiled_and_patch_parallel_bitwise_with_single_frame_tiles_and_vae_fast_within_gates(tiny_pipe, dtype):
    """tiled_decode and patch-parallel: every tile uncached, stock bit for bit, partial edge tiles; vae_fast on every
    tile (with or without vae_exact) within its SSIM / PSNR gates."""
    z = latent(20, 12, dtype)
    with tiled(tiny_pipe, dtype) as vae:
        with decoder_calls(vae) as stock_path:
            ref_tiled, ref_pp = decode(vae, z), parallel_decode(vae, z)
        assert stock_path == ["stock"] * 16  # 8 tiles, twice: it really tiles
        api.select("none,+vae_exact", model=tiny_pipe)
        assert OPT.piece_report(tiny_pipe)["single_frame_tiles"] == ""
        with decoder_calls(vae) as path:
            got_tiled, got_pp = decode(vae, z), parallel_decode(vae, z)
        assert path == ["single_frame"] * 16
        assert OPT.stats["tiled_decodes"] == 1 and OPT.stats["tiles"] == 16
        assert OPT.fallback_reasons() == {}  # no "stock tiled_decode path kept" any more
        for spec in ("none,+vae_fast", "none,+vae_exact,+vae_fast"):
            api.select(spec, model=tiny_pipe)
            got = decode(vae, z)
            q = compare_images(ref_tiled[:, :, 0].float(), got[:, :, 0].float())
            assert not torch.equal(ref_tiled, got) or dtype == torch.bfloat16, spec  # fp32: the last tap changes bits
            assert q["ssim"] >= 0.99 and q["psnr"] >= 35.0, (spec, q)
            assert vae_fast.OPT.piece_report(tiny_pipe)["conv2d_last_tap"] == ""
            api.select("none", model=tiny_pipe)
    assert ref_tiled.shape == (1, 3, 1, 80, 48) and ref_tiled.dtype == dtype
    assert torch.equal(ref_tiled, got_tiled)
    assert torch.equal(ref_pp, got_pp)


def test_tiled_decode_keeps_at_most_two_rows_of_tiles(tiny_pipe, monkeypatch):
    """Each row is blended once decoded and the row above dropped: two rows alive at most, same result, lower peak."""
    z = latent(40, 12, torch.float32)  # 7 rows of 2 tiles
    decoded: list[weakref.ref] = []
    alive: list[int] = []
    real = vae_exact.decode_tile

    def counting(v: nn.Module, tile: torch.Tensor) -> torch.Tensor:
        alive.append(sum(r() is not None for r in decoded))  # tiles still alive when the next one is decoded
        out = real(v, tile)
        decoded.append(weakref.ref(out))
        return out

    monkeypatch.setattr(vae_exact, "decode_tile", counting)
    with tiled(tiny_pipe) as vae:
        ref, stock = measure(decode, vae, z)
        api.select("none,+vae_exact", model=tiny_pipe)
        got, ours = measure(decode, vae, z)
        assert OPT.stats["tiles"] == 14
    assert torch.equal(ref, got)
    assert len(alive) == 14 and max(alive) == 3, alive  # two rows of 2, minus the one being replaced, plus one
    assert ours.peak < stock.peak, (ours.peak, stock.peak)


# ----- install / detach / idempotence / other models ------------------------------------------------------------------
def test_attach_detach_restore_by_identity_and_the_loader_hook_attaches(tiny_pipe):
    vae = tiny_pipe.vae
    decode_before = vae.decode  # vLLM-Omni's profiler may wrap this per instance: never touched
    assert patched_anywhere(tiny_pipe) == []
    assert api.select("none,+vae_exact", model=tiny_pipe) == ["vae_exact"]
    assert OPT.is_attached(tiny_pipe) and OPT.reasons_inactive(tiny_pipe) == []
    patched = patched_anywhere(tiny_pipe)
    assert "" in patched and "vae" in patched and "vae.post_quant_conv" in patched
    assert vars(vae)["_decode"].__func__.__name__ == "_decode"
    n = len(patched)
    OPT.attach(tiny_pipe)  # idempotent
    OPT.attach(vae)  # the same VAE through another model: refused, not patched twice
    assert OPT.reasons_inactive(vae) == ["its VAE is already attached through another model"]
    assert len(patched_anywhere(tiny_pipe)) == n
    assert vae.decode == decode_before
    api.select("none", model=tiny_pipe)
    OPT.detach(tiny_pipe)  # idempotent
    assert patched_anywhere(tiny_pipe) == []
    assert vae._decode.__func__ is AutoencoderKLQwenImage._decode
    assert vae.clear_cache.__func__ is AutoencoderKLQwenImage.clear_cache
    assert not OPT.is_attached(tiny_pipe)
    api.select("none,+vae_exact")  # the plugin's loader hook: attach_all on every pipeline the loader returns
    assert _plugin.attach_all(tiny_pipe) == ["vae_exact"]
    assert OPT.is_attached(tiny_pipe) and "_decode" in vars(tiny_pipe.vae)
    assert _plugin.attach_all(tiny_pipe.transformer) == []  # not a VAE: nothing acts, with a reason
    api.select("default")
    rows = {r["name"]: r for r in api.status()}
    assert rows["vae_exact"]["active"] and rows["vae_exact"]["default"]
    assert rows["vae_exact"]["equivalence"] == "exact"


def test_uninstall_clears_the_upsample_verdicts_and_detaches_everything(vaes, monkeypatch):
    """clear_cache resets without walking modules; uninstall detaches all and drops the upsample verdicts."""
    vae = vaes[torch.bfloat16]
    api.select("none,+vae_exact", model=vae)
    decode(vae, latent(4, 4, torch.bfloat16))
    with monkeypatch.context() as m:
        m.setattr(nn.Module, "modules", lambda self: pytest.fail("clear_cache walked the module tree"))
        vae.clear_cache()
    assert vae._feat_map == [None] * vae._cached_conv_counts["decoder"]
    assert vae._enc_feat_map == [None] * vae._cached_conv_counts["encoder"]
    probe = _backend.probe_id()
    assert patched_anywhere(vae)
    assert [(v.key, v.ok) for v in OPT.upsample.firsts.values()] == [(("cpu", torch.bfloat16), True)]
    api.select("none")
    assert patched_anywhere(vae) == [] and not OPT.installed
    assert _backend.probe_id() == probe and len(OPT.upsample.firsts) == 0


def test_reasons_for_other_models_and_a_pipeline_overriding_decode_latents(tiny_pipe, vaes):
    from vllm_omni.diffusion.models.qwen_image.autoencoder_kl_qwenimage import (
        AutoencoderKLQwenImage as InTreeVae,
    )

    api.select("none,+vae_exact")
    assert OPT.reasons_inactive() == []
    transformer = tiny_pipe.transformer
    OPT.attach(transformer)
    assert "neither a Qwen-Image VAE nor a pipeline" in OPT.reasons_inactive(transformer)[0]
    assert patched_anywhere(transformer) == []

    holder = nn.Module()
    holder.vae = InTreeVae(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[False])
    OPT.attach(holder)
    assert "not diffusers' AutoencoderKLQwenImage" in OPT.reasons_inactive(holder)[0]
    assert patched_anywhere(holder) == []

    class OtherPipeline(nn.Module):  # overrides _decode_latents: keeps its own
        def _decode_latents(self, *a, **k):
            return "theirs"

    pipe = OtherPipeline()
    pipe.vae = vaes[torch.float32]
    OPT.attach(pipe)
    report = OPT.piece_report(pipe)
    assert "is not QwenImagePipeline's" in report["latents_stats_cache"]
    assert report["single_frame_decode"] == "" and OPT.reasons_inactive(pipe) == []
    assert "_decode_latents" not in vars(pipe)
    OPT.detach(pipe)
    assert patched_anywhere(pipe) == []


# ----- cache policies (one-entry latents statistics) and compile-safe bookkeeping -------------------------------------
def _stock_stats(cfg, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """QwenImagePipeline._decode_latents' own ops for the mean and 1/std tensors."""
    mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(device, dtype)
    return mean, 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(device, dtype)


def test_latents_stats_one_entry_rebuilt_on_another_device_dtype_or_config(monkeypatch):
    """One entry keyed on (device, dtype, z_dim, mean, std): each call changes one and gets stock-equal tensors."""
    stats = vae_exact.LatentsStats()
    cfg = SimpleNamespace(z_dim=4, latents_mean=list(MEAN), latents_std=list(STD))
    cpu, meta = torch.device("cpu"), torch.device("meta")
    builds = []
    real_tensor = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: builds.append(1) or real_tensor(*a, **k))

    def get(c, device, dtype):
        out = stats.get(c, device, dtype)
        assert len(stats) == 1  # one entry, whatever came before
        if device.type == "cpu":
            with monkeypatch.context() as m:
                m.setattr(torch, "tensor", real_tensor)
                want = _stock_stats(c, device, dtype)
            assert all(o.dtype == w.dtype and torch.equal(o, w) for o, w in zip(out, want, strict=True))
        assert all(t.device.type == device.type and t.dtype == dtype for t in out)
        return out

    first = get(cfg, cpu, torch.float32)
    assert get(cfg, cpu, torch.float32) is first and len(builds) == 2  # reused: built once (mean and std)
    get(cfg, cpu, torch.bfloat16)  # another dtype
    get(cfg, meta, torch.bfloat16)  # another device (a move)
    get(cfg, cpu, torch.bfloat16)  # back on the CPU: rebuilt (one entry, the CPU one was dropped)
    get(SimpleNamespace(z_dim=4, latents_mean=[m + 1 for m in MEAN], latents_std=list(STD)), cpu, torch.bfloat16)
    get(SimpleNamespace(z_dim=4, latents_mean=list(MEAN), latents_std=[s * 2 for s in STD]), cpu, torch.bfloat16)
    assert len(builds) == 2 * 6
    assert get(cfg, cpu, torch.float32) is not first and len(builds) == 2 * 7  # the first entry is long gone


def test_tracing_runs_stock_decode_and_upsample_verification_refuses_a_wrong_kernel(vaes, monkeypatch):
    """Under tracing the patched VAE runs stock's ops: no fallback counted, no upsample verdict (bf16); a device whose
    bf16 nearest interpolation disagrees with the fp32 one keeps stock's round trip."""
    vae = vaes[torch.bfloat16]
    z = latent(4, 4, torch.bfloat16)
    with monkeypatch.context() as m:
        m.setattr(torch.compiler, "is_compiling", lambda: True)
        ref, stock = count_ops(lambda: decode(vae, z))
        api.select("none,+vae_exact", model=vae)
        OPT.upsample.clear()
        with decoder_calls(vae) as path:
            got, traced = count_ops(lambda: decode(vae, z))
    assert path == ["stock"] and torch.equal(ref, got)
    assert traced.counts == stock.counts
    assert OPT.fallback_reasons() == {} and len(OPT.upsample.firsts) == 0
    with decoder_calls(vae) as path:  # outside tracing the same attached VAE takes its own path again
        _, ours = count_ops(lambda: decode(vae, z))
    assert path == ["single_frame"] and ours.total < stock.total and len(OPT.upsample.firsts) == 1
    real = torch.nn.functional.interpolate

    def wrong_in_bf16(x, *a, **k):
        y = real(x, *a, **k)
        return y + 1 if x.dtype == torch.bfloat16 else y

    monkeypatch.setattr(torch.nn.functional, "interpolate", wrong_in_bf16)
    OPT.upsample.clear()
    assert torch.equal(decode(vae, z), ref)
    assert [(v.key, v.ok) for v in OPT.upsample.firsts.values()] == [(("cpu", torch.bfloat16), False)]


def test_tracing_runs_stock_tiled_decode_without_bookkeeping_and_multi_frame_too(tiny_pipe, monkeypatch):
    """Under tracing tiled_decode / tile_exec run stock code, none counted; multi-frame takes stock with a reason."""
    z, z3 = latent(20, 12, torch.float32), latent(12, 6, torch.float32, t=3)
    with tiled(tiny_pipe) as vae:
        ref, ref3 = decode(vae, z), decode(vae, z3)
        api.select("none,+vae_exact", model=tiny_pipe)
        with monkeypatch.context() as m, decoder_calls(vae) as path:
            m.setattr(torch.compiler, "is_compiling", lambda: True)
            got, got_pp = decode(vae, z), parallel_decode(vae, z)
        assert path == ["stock"] * 16 and OPT.stats["tiles"] == 0 and OPT.fallback_reasons() == {}
        got3 = decode(vae, z3)
        assert OPT.stats["tiled_decodes"] == 0
        assert any("multi-frame" in r for r in OPT.fallback_reasons())
    assert torch.equal(ref, got) and torch.equal(ref, got_pp)
    assert ref3.shape[2] == 5 and torch.equal(ref3, got3)  # 1 + 4 * 1 frames: the time conv ran
