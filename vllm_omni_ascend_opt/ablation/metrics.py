"""Image-quality metrics for approximate ("close") optimizations: SSIM, PSNR, pixel identity, abs diffs.

The gates, fixed before any measurement: SSIM >= 0.99 and PSNR >= 35 dB against stock. Inputs are float ``[B, 3, H,
W]`` (or ``[3, H, W]``) in ``value_range`` (default ``(-1, 1)``, clipped). SSIM and PSNR are computed per image on the
8-bit images a user would save (``data_range=255``) and the batch's worst is reported; identical images: ``psnr ==
inf``. ``max_abs_diff`` / ``mean_abs_diff`` are taken on the float inputs.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

#: The project's acceptance gates for a "close" optimization, against stock.
SSIM_GATE = 0.99
PSNR_GATE_DB = 35.0


def _as_numpy(images: Any) -> np.ndarray:
    """Float64 numpy ``[B, C, H, W]`` from a torch tensor or array (``[C, H, W]`` gets a batch axis)."""
    if hasattr(images, "detach"):  # torch.Tensor without importing torch here
        images = images.detach().float().cpu().numpy()
    arr = np.asarray(images, dtype=np.float64)
    if arr.ndim == 3:
        arr = arr[None]
    if arr.ndim != 4:
        raise ValueError(f"expected images of shape [B, C, H, W] or [C, H, W], got {arr.shape}")
    return arr


def to_uint8(images: Any, value_range: tuple[float, float] = (-1.0, 1.0)) -> np.ndarray:
    """8-bit ``[B, H, W, C]`` images, as a user would save them: clip to ``value_range``, scale, round."""
    lo, hi = value_range
    if not hi > lo:
        raise ValueError(f"value_range must be (low, high) with high > low, got {value_range}")
    x01 = np.clip((_as_numpy(images) - lo) / (hi - lo), 0.0, 1.0)
    return np.round(x01 * 255.0).astype(np.uint8).transpose(0, 2, 3, 1)


def _psnr(ref: np.ndarray, out: np.ndarray) -> float:
    """PSNR of two 8-bit HWC images (skimage, data_range=255); ``inf`` when they are identical."""
    from skimage.metrics import peak_signal_noise_ratio

    if np.array_equal(ref, out):
        return math.inf
    return float(peak_signal_noise_ratio(ref, out, data_range=255))


def _ssim(ref: np.ndarray, out: np.ndarray) -> float:
    """SSIM of two 8-bit HWC images (skimage, data_range=255, channel_axis=-1); window shrunk for tiny images."""
    from skimage.metrics import structural_similarity

    side = min(ref.shape[0], ref.shape[1])
    win = min(7, side if side % 2 else side - 1)
    if win < 3:
        raise ValueError(f"images of {ref.shape[:2]} are too small for SSIM (need at least 3x3)")
    return float(structural_similarity(ref, out, data_range=255, channel_axis=-1, win_size=win))


def compare_images(ref: Any, out: Any, *, value_range: tuple[float, float] = (-1.0, 1.0)) -> dict[str, Any]:
    """``dict(pixel_identical, max_abs_diff, mean_abs_diff, ssim, psnr)`` of ``out`` against ``ref`` (same shape)."""
    a, b = _as_numpy(ref), _as_numpy(out)
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: ref {a.shape} vs out {b.shape}")
    diff = np.abs(a - b)
    ra, rb = to_uint8(a, value_range), to_uint8(b, value_range)
    return {
        "pixel_identical": bool(np.array_equal(ra, rb)),
        "max_abs_diff": float(diff.max()),
        "mean_abs_diff": float(diff.mean()),
        "ssim": min(_ssim(x, y) for x, y in zip(ra, rb, strict=True)),
        "psnr": min(_psnr(x, y) for x, y in zip(ra, rb, strict=True)),
    }


def passes_gates(metrics: dict[str, Any], *, ssim_min: float = SSIM_GATE, psnr_min: float = PSNR_GATE_DB) -> bool:
    """True when ``compare_images`` output meets SSIM >= ``ssim_min`` and PSNR >= ``psnr_min`` dB."""
    return metrics["ssim"] >= ssim_min and metrics["psnr"] >= psnr_min
