"""Approximate public Ascend 910B figures (third-party; no per-SKU table from Huawei) the device-time model starts from.

They set the compute floor (FLOPs / peak) and show the fitted values as fractions of peak; the predictions depend on
the fitted values. [PEAK-B] BF16 peak TFLOPS as commonly quoted; [HBM] 64 GB HBM2e at ~1.6 TB/s; [HCCS] Atlas 800T
A2: 8 NPUs fully connected, 7 links x 56 GB/s per NPU.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Per-collective start-up latency assumed for HCCL over HCCS (no public figure found): an assumption.
HCCL_LATENCY_US = 20.0


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    peak_tflops: float  # BF16 dense, cube unit
    hbm_gbps: float  # GB/s
    hccs_gbps: float  # GB/s per NPU, all links
    source: str


SPECS: dict[str, DeviceSpec] = {
    "910B1": DeviceSpec("910B1", 414.0, 1600.0, 392.0, "approximate public figures [PEAK-B][HBM][HCCS]"),
    "910B3": DeviceSpec("910B3", 313.0, 1600.0, 392.0, "approximate public figures [PEAK-B][HBM][HCCS]"),
}
