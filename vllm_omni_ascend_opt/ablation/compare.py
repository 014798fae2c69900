"""Image equivalence for the ablation runner: :mod:`vllm_omni_ascend_opt.ablation.metrics` on the stored images
(``.npy``: the float output in [-1, 1]; ``.png``: 8-bit; ``bitwise_identical`` None without both floats), and the
tiers' gates."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vllm_omni_ascend_opt.ablation import metrics


@dataclass
class StoredImage:
    uint8: np.ndarray  # [H, W, 3]
    float_chw: np.ndarray | None  # [3, H, W] in [-1, 1], as vLLM-Omni returned it

    def as_float(self) -> np.ndarray:
        """The float output, or the 8-bit image mapped back to [-1, 1] (same 8-bit image after post-processing)."""
        if self.float_chw is not None:
            return self.float_chw.astype(np.float64)
        return self.uint8.astype(np.float64).transpose(2, 0, 1) / 255.0 * 2.0 - 1.0


def to_uint8(chw_minus1_1: np.ndarray) -> np.ndarray:
    """vLLM-Omni / diffusers post-processing of a [3, H, W] float image in [-1, 1] to uint8 HWC."""
    return metrics.to_uint8(chw_minus1_1)[0]


def load_stored(stem: Path) -> StoredImage:
    """Load ``stem.npy`` (float, preferred) and/or ``stem.png`` written by a worker."""
    npy, png = stem.with_suffix(".npy"), stem.with_suffix(".png")
    if npy.is_file():
        arr = np.load(npy)
        if arr.dtype == np.uint8:
            return StoredImage(arr, None)
        return StoredImage(to_uint8(arr), arr)
    if png.is_file():
        return StoredImage(read_png(png), None)
    raise FileNotFoundError(f"no image stored at {stem}.npy/.png")


def read_png(path: Path) -> np.ndarray:
    """An image file as uint8 RGB [H, W, 3]."""
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"), dtype=np.uint8)


def compare(ref: StoredImage, out: StoredImage) -> dict[str, Any]:
    """Every metric of ``out`` against ``ref`` (see the module docstring)."""
    if ref.uint8.shape != out.uint8.shape:
        raise ValueError(f"image shapes differ: {ref.uint8.shape} vs {out.uint8.shape}")
    both_float = ref.float_chw is not None and out.float_chw is not None
    m = metrics.compare_images(ref.as_float(), out.as_float())
    return {
        "pixel_identical": bool(np.array_equal(ref.uint8, out.uint8)),
        "bitwise_identical": bool(np.array_equal(ref.float_chw, out.float_chw)) if both_float else None,
        "max_abs_diff": float(m["max_abs_diff"]),
        "mean_abs_diff": float(m["mean_abs_diff"]),
        "ssim": float(m["ssim"]),
        "psnr_db": float(m["psnr"]),
        "basis": "float" if both_float else "uint8",
    }


#: The per-sample metrics of :func:`compare`.
METRIC_KEYS = ("pixel_identical", "bitwise_identical", "max_abs_diff", "mean_abs_diff", "ssim", "psnr_db", "basis")


def aggregate(per_sample: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Worst case over the samples of one pair of configurations."""
    vals = list(per_sample.values())
    if not vals:
        return {}
    bitwise = [v["bitwise_identical"] for v in vals]
    return {
        "pixel_identical": all(v["pixel_identical"] for v in vals),
        "bitwise_identical": None if any(b is None for b in bitwise) else all(bitwise),
        "max_abs_diff": max(v["max_abs_diff"] for v in vals),
        "mean_abs_diff": float(np.mean([v["mean_abs_diff"] for v in vals])),
        "ssim_min": min(v["ssim"] for v in vals),
        "psnr_db_min": min(v["psnr_db"] for v in vals),
        "basis": vals[0]["basis"],
        "samples": len(vals),
    }


def gate(agg: dict[str, Any], equivalence: str, ssim_gate: float, psnr_gate: float) -> dict[str, Any]:
    """Judge an aggregated comparison by a tier (exact, pixel, or close: the SSIM and PSNR gates on every sample)."""
    if not agg:
        return {"class": equivalence, "passed": None, "why": "not compared (an image is missing)"}
    if equivalence == "exact" and agg.get("bitwise_identical") is not None:
        ok = bool(agg["bitwise_identical"])
        why = "bitwise-identical" if ok else f"float outputs differ (max abs diff {agg['max_abs_diff']:.3g})"
        if not ok and agg["pixel_identical"]:
            why += "; the uint8 images are identical (would pass the pixel tier)"
        return {"class": "exact", "passed": ok, "why": why}
    if equivalence in ("exact", "pixel"):
        ok = bool(agg["pixel_identical"])
        diff = f"max abs diff {agg['max_abs_diff']:.3g}, SSIM {agg['ssim_min']:.4f}"
        why = "pixel-identical" if ok else f"not pixel-identical ({diff})"
        return {"class": equivalence, "passed": ok, "why": why}
    ok = agg["ssim_min"] >= ssim_gate and agg["psnr_db_min"] >= psnr_gate
    why = f"SSIM {agg['ssim_min']:.4f} {'>=' if agg['ssim_min'] >= ssim_gate else '<'} {ssim_gate}, PSNR {fmt_db(agg['psnr_db_min'])} {'>=' if agg['psnr_db_min'] >= psnr_gate else '<'} {psnr_gate} dB"
    return {"class": "close", "passed": bool(ok), "why": why}


def fmt_db(v: float) -> str:
    return "inf dB" if math.isinf(v) else f"{v:.2f} dB"
