"""`vae_exact`: VAE decode work that never changes a bit for single-frame images, removed (:class:`VaeExact`).

Pieces, patched per instance (``_vae_common``): ``single_frame_decode``, ``single_frame_tiles``, ``cached_conv_counts``,
``upsample_native_dtype``, ``pointwise_conv_no_pad`` and ``latents_stats_cache``.
"""

from __future__ import annotations

import sys
from types import MethodType
from typing import Any

import torch
import torch.nn as nn

from vllm_omni_ascend_opt._patching import PatchSet
from vllm_omni_ascend_opt.blocks.kernels.verdicts import Verdict
from vllm_omni_ascend_opt.blocks.kernels.verified import KernelPath
from vllm_omni_ascend_opt.blocks.upstream import guards
from vllm_omni_ascend_opt.blocks.upstream import targets as _targets
from vllm_omni_ascend_opt.blocks.upstream.fingerprints import same
from vllm_omni_ascend_opt.opts._vae_common import (
    VaeOptimization,
    diffusers_vae,
    of_exact_class,
)


def tiling_applies(vae: nn.Module, z: torch.Tensor) -> bool:
    """Whether diffusers' ``_decode`` hands ``z`` over to ``tiled_decode``."""
    ratio = vae.spatial_compression_ratio
    too_big = z.shape[-1] > vae.tile_sample_min_width // ratio or z.shape[-2] > vae.tile_sample_min_height // ratio
    return bool(vae.use_tiling and too_big)


#: Why a latent of more than one frame (``.format(frames)``) keeps stock code.
_MULTI_FRAME = "multi-frame latent (T = {}): the feature cache carries state between frames"


def single_frame_refusal(z: torch.Tensor) -> str:
    """Why ``z`` must take the stock ``_decode`` ("" when the cache-less single-frame path applies)."""
    if z.dim() != 5:
        return f"latent of {z.dim()} dims (expected [B, C, T, H, W])"
    if z.shape[2] != 1:
        return _MULTI_FRAME.format(z.shape[2])
    return ""


def _replaced(obj: Any, *attrs: str) -> str:
    """Why ``obj`` is left alone when one of ``attrs`` is already replaced on the instance ("" when none is)."""
    return f"{' / '.join(attrs)} is already replaced on this instance" if any(a in vars(obj) for a in attrs) else ""


def _make_decode(opt: VaeExact, vae: nn.Module) -> Any:
    original = vae._decode  # bound stock method (or whatever was there), called on fallback

    def _decode(self: nn.Module, z: torch.Tensor, return_dict: bool = True) -> Any:
        if guards.tracing():  # first: stock code, no bookkeeping while dynamo traces
            return original(z, return_dict=return_dict)
        if z.dim() == 5 and tiling_applies(self, z):
            return self.tiled_decode(z, return_dict=return_dict)  # stock's hand-over
        if why := single_frame_refusal(z):
            opt._fallback(why)
            return original(z, return_dict=return_dict)
        # For one frame stock's cached decode is the decoder without a cache, minus the clones stored for a next frame.
        opt.stats["single_frame_decodes"] += 1
        out = torch.clamp(decode_tile(self, z), min=-1.0, max=1.0)
        self.clear_cache()  # leave the same (fresh) cache state as stock
        return diffusers_vae().DecoderOutput(sample=out) if return_dict else (out,)

    return _decode


def tiles_refusal(vae: nn.Module) -> str:
    """Why the tiled decode of ``vae`` keeps stock code ("" when ``single_frame_tiles`` can act)."""
    known = {diffusers_vae().AutoencoderKLQwenImage.tiled_decode}
    if (dist := sys.modules.get(_targets.DIST_VAE)) is not None:
        known.add(dist.DistributedAutoencoderKLQwenImage.tiled_decode)
    if getattr(type(vae), "tiled_decode", None) not in known:
        return f"{type(vae).__name__} overrides tiled_decode"
    return _replaced(vae, "tiled_decode", "tile_exec")


def decode_tile(vae: nn.Module, tile: torch.Tensor) -> torch.Tensor:
    """A single-frame latent or tile decoded as stock does, without the feature cache (minus its clones)."""
    return vae.decoder(vae.post_quant_conv(tile))


def tiled_decode_single_frame(opt: VaeExact, vae: nn.Module, z: torch.Tensor) -> torch.Tensor:
    """diffusers' ``AutoencoderKLQwenImage.tiled_decode`` for a one-frame latent, bitwise: the same tiles, crops and
    blends in the same order, each row blended once decoded (stock decodes every tile first)."""
    _, _, _, height, width = z.shape
    ratio = vae.spatial_compression_ratio
    min_h, min_w = vae.tile_sample_min_height // ratio, vae.tile_sample_min_width // ratio
    stride_h, stride_w = vae.tile_sample_stride_height // ratio, vae.tile_sample_stride_width // ratio
    blend_height = vae.tile_sample_min_height - vae.tile_sample_stride_height
    blend_width = vae.tile_sample_min_width - vae.tile_sample_stride_width
    above: list[torch.Tensor] | None = None
    result_rows = []
    for i in range(0, height, stride_h):
        row = [decode_tile(vae, z[:, :, 0:1, i : i + min_h, j : j + min_w]) for j in range(0, width, stride_w)]
        opt.stats["tiles"] += len(row)
        result_row = []
        for j, tile in enumerate(row):
            if above is not None:
                tile = vae.blend_v(above[j], tile, blend_height)
            if j > 0:
                tile = vae.blend_h(row[j - 1], tile, blend_width)
            result_row.append(tile[:, :, :, : vae.tile_sample_stride_height, : vae.tile_sample_stride_width])
        result_rows.append(torch.cat(result_row, dim=-1))
        above = row
    vae.clear_cache()  # stock leaves a fresh cache after its tiles
    return torch.cat(result_rows, dim=3)[:, :, :, : height * ratio, : width * ratio]


def _make_tiled_decode(opt: VaeExact, vae: nn.Module) -> Any:
    original = vae.tiled_decode

    def tiled_decode(self: nn.Module, z: torch.Tensor, return_dict: bool = True) -> Any:
        if guards.tracing():  # first: stock tiled_decode, nothing counted while dynamo traces
            return original(z, return_dict=return_dict)
        distributed = getattr(self, "is_distributed_enabled", None)
        if callable(distributed) and distributed():
            return original(z, return_dict=return_dict)  # vLLM-Omni's executor: its tiles go through tile_exec
        if why := single_frame_refusal(z):
            opt._fallback(why)
            return original(z, return_dict=return_dict)
        opt.stats["tiled_decodes"] += 1
        dec = tiled_decode_single_frame(opt, self, z)
        return diffusers_vae().DecoderOutput(sample=dec) if return_dict else (dec,)

    return tiled_decode


def _make_tile_exec(opt: VaeExact, vae: nn.Module) -> Any:
    original = vae.tile_exec

    def tile_exec(self: nn.Module, task: Any) -> torch.Tensor:
        """vLLM-Omni's ``tile_exec`` for a one-frame tile: :func:`decode_tile` (``tile_merge`` clears the cache)."""
        if guards.tracing():
            return original(task)
        frames = list(task.tensor)
        if len(frames) != 1 or frames[0].dim() != 5:
            opt._fallback(_MULTI_FRAME.format(len(frames)))
            return original(task)
        opt.stats["tiles"] += 1
        return decode_tile(self, frames[0])

    return tile_exec


def conv_counts_refusal(vae: nn.Module) -> str:
    """Why ``cached_conv_counts`` leaves ``vae`` alone ("" when diffusers' cached counts match its convolutions)."""
    cached = getattr(vae, "_cached_conv_counts", None)
    if not isinstance(cached, dict) or not {"decoder", "encoder"} <= cached.keys():
        return "this diffusers has no _cached_conv_counts"
    cls = diffusers_vae().QwenImageCausalConv3d
    parts = {"decoder": vae.decoder, "encoder": vae.encoder}
    fresh = {k: 0 if part is None else sum(isinstance(m, cls) for m in part.modules()) for k, part in parts.items()}
    if {k: cached[k] for k in fresh} != fresh:
        return f"_cached_conv_counts {cached} disagree with the modules {fresh}"
    return _replaced(vae, "clear_cache")


def _clear_cache(self: nn.Module) -> None:
    """diffusers' ``clear_cache`` with the conv counts it cached in ``__init__`` (same resulting state)."""
    if guards.tracing():
        return type(self).clear_cache(self)  # the class's (attach refuses a VAE whose instance already replaced it)
    counts = self._cached_conv_counts
    self._conv_num = counts["decoder"]
    self._conv_idx = [0]
    self._feat_map = [None] * self._conv_num
    self._enc_conv_num = counts["encoder"]
    self._enc_conv_idx = [0]
    self._enc_feat_map = [None] * self._enc_conv_num


class UpsamplePath(KernelPath):
    """Nearest interpolation in the activation dtype, checked per (device type, dtype) on a probe."""

    kernel = "native-dtype upsample"
    persist = False

    def check(self, module: nn.Module, device: torch.device, dtype: torch.dtype) -> Verdict:
        key = (device.type, dtype)
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):  # an fp32 round trip of these is lossless
            return self.verdict(key, False, "the fp32 round trip is not lossless in this dtype")
        gen = torch.Generator().manual_seed(0)  # CPU generator: never touches the device RNG state
        probe = (torch.randn(2, 3, 5, 7, generator=gen) * 100).to(device=device, dtype=dtype)
        same = torch.equal(nn.Upsample.forward(module, probe), diffusers_vae().QwenImageUpsample.forward(module, probe))
        return self.verdict(key, same, f"{'equal to' if same else 'differs from'} stock's fp32 round trip on a probe")

    def verified(self, module: nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
        v = self.decide((device.type, dtype), lambda: self.check(module, device, dtype))
        return v is not None and v.ok


def _make_upsample_forward(path: UpsamplePath, module: nn.Module) -> Any:
    original = module.forward

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        verified = not guards.tracing() and path.verified(self, x.device, x.dtype)
        return nn.Upsample.forward(self, x) if verified else original(x)

    return forward


def _is_pointwise_causal_conv(m: nn.Module) -> bool:
    """A stock causal convolution without any padding (the 1x1x1 ones): its zero-width ``F.pad`` only copies."""
    cls = diffusers_vae().QwenImageCausalConv3d
    return (
        of_exact_class(m, cls) and not any(m._padding) and tuple(m.padding) == (0, 0, 0) and m.padding_mode == "zeros"
    )


def _make_pointwise_forward(module: nn.Module) -> Any:
    original = module.forward

    def forward(self: nn.Module, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
        # Stock: F.pad(x, [0] * 6) (a contiguous copy; cache_x is ignored when the temporal pad is 0) then Conv3d.
        return nn.Conv3d.forward(self, x) if not guards.tracing() and x.is_contiguous() else original(x, cache_x)

    return forward


def decode_latents_refusal(pipe: Any | None) -> str:
    """Why ``latents_stats_cache`` leaves ``pipe`` alone ("" when it can act)."""
    if pipe is None:
        return "attached to a bare VAE (no pipeline _decode_latents)"
    if (mod := sys.modules.get(_targets.PIPELINE)) is None:
        return f"{_targets.PIPELINE} is not imported"
    stock = getattr(getattr(mod, "QwenImagePipeline", None), "_decode_latents", None)
    if stock is None or getattr(type(pipe), "_decode_latents", None) is not stock:
        return f"{type(pipe).__name__}._decode_latents is not QwenImagePipeline's (vLLM-Omni 0.30)"
    return _replaced(pipe, "_decode_latents")


class LatentsStats:
    """The latents mean and 1/std of one pipeline, built by stock's ops once per (device, dtype, config); one entry."""

    def __init__(self) -> None:
        self._entries: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, cfg: Any, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (device, dtype, cfg.z_dim, tuple(cfg.latents_mean), tuple(cfg.latents_std))
        hit = self._entries.get(key)
        if hit is None:
            mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(device, dtype)
            inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(device, dtype)
            self._entries.clear()  # one entry
            hit = self._entries[key] = (mean, inv_std)
        return hit

    def __len__(self) -> int:
        return len(self._entries)


def _make_decode_latents(pipe: Any) -> Any:
    DiffusionOutput = sys.modules[_targets.PIPELINE].DiffusionOutput
    original = pipe._decode_latents
    stats = LatentsStats()

    def _decode_latents(self: Any, latents: torch.Tensor, height: int, width: int, output_type: str = "pil") -> Any:
        """QwenImagePipeline._decode_latents (vLLM-Omni 0.30) with the mean / 1/std tensors built once."""
        if guards.tracing() or output_type == "latent":
            return original(latents, height, width, output_type)
        latents = self._unpack_latents(latents, height, width, self.vae_scale_factor)
        latents = latents.to(self.vae.dtype)
        latents_mean, latents_std = stats.get(self.vae.config, latents.device, latents.dtype)
        latents = latents / latents_std + latents_mean
        image = self.vae.decode(latents, return_dict=False)[0][:, :, 0]
        return DiffusionOutput(output=image, stage_durations=getattr(self, "stage_durations", None))

    return _decode_latents


class VaeExact(VaeOptimization):
    name = "vae_exact"
    summary = "Remove VAE decode work that never changes a bit for single-frame images."
    why = (
        "Qwen-Image's VAE is the Wan video VAE: each still-image decode clones every causal convolution's input "
        "into a feature cache only a next frame would read, round-trips each nearest upsample through fp32, "
        "copies each 1x1x1 convolution's input through a zero-width F.pad, recounts the convolutions on each "
        "clear_cache and re-creates the latents mean and std on every call."
    )
    how = (
        "For one frame every cache slot is None, so a decode without the cache is the same computation minus the "
        "clones (tiled decodes too, with stock's blending); clear_cache uses diffusers' cached conv counts "
        "(checked at attach); nearest upsampling runs in the input dtype (verified on a probe); a contiguous "
        "input goes straight to a 1x1x1 convolution's Conv3d; the latents statistics are built once per device, "
        "dtype and config. Only copies, lossless casts and bookkeeping are removed: bitwise stock. Multi-frame "
        "decodes keep stock's path."
    )
    upstream_pr = "None upstream; ComfyUI #12090 (merged) skips the Wan VAE's feature cache for single frames."
    removal_plan = "Drop each piece once diffusers (and vLLM-Omni, for the latents statistics) do the same."
    equivalence = "exact"
    upstream = (
        _targets.VAE_DECODE,
        _targets.CAUSAL_CONV_FORWARD,
        same(_targets.DIFFUSERS_VAE, "AutoencoderKLQwenImage.clear_cache", "31708750dd8c83e0"),
        same(_targets.DIFFUSERS_VAE, "QwenImageUpsample.forward", "ee587f434809e4b8"),
        same(_targets.DIFFUSERS_VAE, "QwenImageResample.forward", "716bf32056d139f0"),
        same(_targets.DIFFUSERS_VAE, "QwenImageResidualBlock.forward", "e0e46a4532d1cf61"),
        same(_targets.DIFFUSERS_VAE, "QwenImageMidBlock.forward", "6832c95d0ba19ca0"),
        same(_targets.DIFFUSERS_VAE, "QwenImageUpBlock.forward", "a1729c9f7cb2d237"),
        same(_targets.DIFFUSERS_VAE, "QwenImageDecoder3d.forward", "b1966dcbe8cbcae3"),
        same(_targets.DIST_VAE, "DistributedAutoencoderKLQwenImage.tiled_decode", "96ab08c2ad536cb8"),
        same(_targets.DIFFUSERS_VAE, "AutoencoderKLQwenImage.tiled_decode", "e738fe5a0cf065e9"),
        same(_targets.DIST_VAE, "DistributedAutoencoderKLQwenImage.tile_exec", "50aec6f1ba18ab37"),
        same(_targets.PIPELINE, "QwenImagePipeline._decode_latents", "61e30597d68a52fb"),
    )
    on_qwen_image_21 = (
        "its VAE (AutoencoderKLQwenImage21) already decodes without the feature cache and with 2-D convolutions; the "
        "two exact pieces left there (native-dtype upsample, latents statistics built once) are not implemented for it"
    )
    pieces = (
        "single_frame_decode",
        "single_frame_tiles",
        "cached_conv_counts",
        "upsample_native_dtype",
        "pointwise_conv_no_pad",
        "latents_stats_cache",
    )

    def __init__(self) -> None:
        super().__init__()
        #: The native-dtype upsample's verdicts per (device type, dtype).
        self.upsample = UpsamplePath(self.name, self.stats)

    def _uninstall(self) -> None:
        self.upsample.clear()

    def notes(self) -> list[str]:
        out = ["multi-frame decodes keep stock _decode / tiled_decode (the submodule pieces still act)"]
        return out + [v.describe() for v in self.upsample.firsts.values()]

    def _patch_pieces(self, pipe: Any | None, vae: nn.Module, ps: PatchSet) -> dict[str, str]:
        report: dict[str, str] = {}
        report["single_frame_decode"] = why = self.wants("single_frame_decode") or _replaced(vae, "_decode")
        if not why:
            ps.set(vae, "_decode", MethodType(_make_decode(self, vae), vae))
        report["single_frame_tiles"] = why = self.wants("single_frame_tiles") or tiles_refusal(vae)
        if not why:
            ps.set(vae, "tiled_decode", MethodType(_make_tiled_decode(self, vae), vae))
            if callable(getattr(vae, "tile_exec", None)):  # vLLM-Omni's distributed VAE (patch parallelism)
                ps.set(vae, "tile_exec", MethodType(_make_tile_exec(self, vae), vae))
        report["cached_conv_counts"] = why = self.wants("cached_conv_counts") or conv_counts_refusal(vae)
        if not why:
            ps.set(vae, "clear_cache", MethodType(_clear_cache, vae))
        report["upsample_native_dtype"] = self.patch_forwards(
            "upsample_native_dtype",
            vae,
            lambda m: of_exact_class(m, diffusers_vae().QwenImageUpsample),
            lambda m: _make_upsample_forward(self.upsample, m),
            ps,
            "no stock QwenImageUpsample in the decoder",
        )
        report["pointwise_conv_no_pad"] = self.patch_forwards(
            "pointwise_conv_no_pad",
            vae,
            _is_pointwise_causal_conv,
            _make_pointwise_forward,
            ps,
            "no stock 1x1x1 causal convolution in the decode path",
        )
        report["latents_stats_cache"] = why = self.wants("latents_stats_cache") or decode_latents_refusal(pipe)
        if not why:
            ps.set(pipe, "_decode_latents", MethodType(_make_decode_latents(pipe), pipe))
        return report


OPT = VaeExact()
