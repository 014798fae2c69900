"""`vae_fast`: single-frame VAE decode with 2-D convolutions and input-dtype RMS norms (:class:`VaeFast`).

Pieces, patched per instance (``_vae_common``): ``conv2d_last_tap`` (decoder causal convs with a temporal kernel > 1)
and ``rms_norm_input_dtype`` (decoder channel-first RMS norms); every other call runs the stock forward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from vllm_omni_ascend_opt._patching import PatchSet
from vllm_omni_ascend_opt.blocks.upstream import guards
from vllm_omni_ascend_opt.blocks.upstream import targets as _targets
from vllm_omni_ascend_opt.blocks.upstream.fingerprints import same
from vllm_omni_ascend_opt.opts._vae_common import (
    VaeOptimization,
    diffusers_vae,
    of_exact_class,
)


def last_tap_eligible(m: nn.Module) -> bool:
    """A stock causal conv whose output on one uncached frame depends only on its last temporal tap."""
    if not of_exact_class(m, diffusers_vae().QwenImageCausalConv3d):
        return False
    kt = m.kernel_size[0]
    pw0, pw1, ph0, ph1, pt0, pt1 = m._padding
    causal = kt > 1 and (pt0, pt1) == (kt - 1, 0)  # kt - 1 zero frames in front: one frame meets only the last tap
    plain = tuple(m.padding) == (0, 0, 0) and tuple(m.dilation) == (1, 1, 1) and m.groups == 1
    return causal and pw0 == pw1 and ph0 == ph1 and plain and m.padding_mode == "zeros"


def _derived(derive: Any) -> Any:
    """``derive(t.detach(), *extra)``, kept until ``t`` is updated, reloaded, moved or re-cast, or ``extra`` changes."""
    state: dict[str, Any] = {"key": None, "value": None}

    def get(t: torch.Tensor, *extra: Any) -> torch.Tensor:
        key = (t.data_ptr(), t.device, t.dtype, t._version, *extra)
        if state["key"] != key:
            state["value"] = derive(t.detach(), *extra)
            state["key"] = key
        return state["value"]

    return get


def _make_last_tap_forward(module: nn.Module) -> Any:
    original = module.forward
    last_tap = _derived(lambda w: w[:, :, -1].contiguous())  # the contiguous last temporal tap
    pw, _, ph, _, _, _ = module._padding
    padding2d, stride2d = (ph, pw), tuple(module.stride[1:])

    def forward(self: nn.Module, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
        if guards.tracing() or cache_x is not None or x.dim() != 5 or x.shape[2] != 1:
            return original(x, cache_x)
        # Stock: F.pad(x, (pw, pw, ph, ph, kt-1, 0)) then Conv3d -> one output frame = conv2d(x, w[:, :, -1]).
        y = F.conv2d(x[:, :, 0], last_tap(self.weight), self.bias, stride2d, padding2d)
        return y.unsqueeze(2)

    return forward


_NORM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def norm_eligible(m: nn.Module) -> bool:
    return of_exact_class(m, diffusers_vae().QwenImageRMS_norm) and bool(m.channel_first)


def _make_norm_forward(module: nn.Module) -> Any:
    original = module.forward
    scaled_gamma = _derived(lambda gamma, scale: gamma * scale)

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if guards.tracing() or x.dtype not in _NORM_DTYPES:
            return original(x)
        # Stock normalizes in fp32; here in x's dtype (bf16 has fp32's range; fp16 accumulates the norm in fp32 and
        # clamps it at fp16's smallest normal).
        if x.dtype == torch.float16:
            norm = torch.linalg.vector_norm(x, dim=1, keepdim=True, dtype=torch.float32)
            norm = norm.to(x.dtype).clamp_min(torch.finfo(x.dtype).tiny)
        else:
            norm = torch.linalg.vector_norm(x, dim=1, keepdim=True).clamp_min(1e-12)  # stock's F.normalize eps
        y = x / norm
        g = scaled_gamma(self.gamma, self.scale)
        y = y.mul_(g) if torch.result_type(y, g) == y.dtype else y * g  # keep stock's type promotion
        bias = self.bias
        if isinstance(bias, torch.Tensor) or bias != 0.0:
            y = y + bias
        return y

    return forward


class VaeFast(VaeOptimization):
    name = "vae_fast"
    summary = "Faster approximate VAE decode, accepted only within SSIM >= 0.99 and PSNR >= 35 dB of stock."
    why = (
        "For a single latent frame, every 3x3x3 causal convolution of the Qwen-Image (Wan) VAE decoder zero-pads "
        "the time axis to 3 frames and runs a Conv3d whose first two temporal taps multiply zeros: 3x the "
        "multiply-adds of the 2-D convolution that gives the result, plus a padded copy of the input; these "
        "convolutions are most of the decode's time. Its RMS norms also round-trip through fp32."
    )
    how = (
        "F.conv2d of the frame with the kernel's last temporal tap, padding inside the convolution; the "
        "channel-first RMS norms as x / ||x|| * (gamma * scale) in the input dtype. The same products summed in "
        "another order differ in the last bits: close, gated at SSIM >= 0.99 and PSNR >= 35 dB against stock."
    )
    upstream_pr = "None in vLLM-Omni or diffusers; sglang #38020 (merged, CUDA) keeps Conv3d (channels-last)."
    removal_plan = "Drop when diffusers' (or vLLM-Omni's) Qwen-Image VAE decodes single frames with 2-D convolutions."
    equivalence = "close"
    default_enabled = False
    upstream = (
        _targets.VAE_DECODE,
        _targets.CAUSAL_CONV_FORWARD,
        _targets.CAUSAL_CONV_INIT,
        same(_targets.DIFFUSERS_VAE, "QwenImageRMS_norm.forward", "2c0e9b884c3c2298"),
    )
    on_qwen_image_21 = "its VAE already decodes single frames with 2-D convolutions (QwenImage21CausalConv3d)"
    pieces = ("conv2d_last_tap", "rms_norm_input_dtype")

    def notes(self) -> list[str]:
        return [
            "single uncached frames only; video frames and cached calls keep Conv3d",
            "keeps a contiguous copy of each 3x3x3 kernel's last tap (1/3 of those weights)",
        ]

    def _patch_pieces(self, pipe: Any | None, vae: nn.Module, ps: PatchSet) -> dict[str, str]:
        return {
            "conv2d_last_tap": self.patch_forwards(
                "conv2d_last_tap",
                vae,
                last_tap_eligible,
                _make_last_tap_forward,
                ps,
                "no stock causal convolution with a temporal kernel > 1 in the decoder",
            ),
            "rms_norm_input_dtype": self.patch_forwards(
                "rms_norm_input_dtype",
                vae,
                norm_eligible,
                _make_norm_forward,
                ps,
                "no stock channel-first QwenImageRMS_norm in the decoder",
            ),
        }


OPT = VaeFast()
