"""Published Ascend 910B figures the device-time model starts from (peaks; the model fits what is reached).

Huawei publishes no per-SKU table this project could find; the third-party figures disagree, so these are
**approximate public figures**, used only for the compute floor (FLOPs / peak) and to show the fitted effective
values as fractions of peak: the predictions depend on the fitted values, not on these peaks.

* [PEAK-B] 910B FP16/BF16 peaks as commonly quoted: B1 ~414, B2 ~376, B3 ~313, B4 ~280 TFLOPS (third-party
  summaries, e.g. https://boardor.com/blog/huawei-ascend-910b-outperforms-h20-910c-approaches-h100).
* [HBM] 64 GB HBM2e at ~1.6 TB/s for 910B1-B3 (third-party; approximate).
* [HCCS] Atlas 800T A2: 8 NPUs fully connected, 7 links x 56 GB/s = 392 GB/s per NPU (third-party). The
  per-collective latency is an assumption (:data:`HCCL_LATENCY_US`).
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
