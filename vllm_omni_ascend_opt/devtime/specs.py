"""Published Ascend 910B figures the device-time model starts from (peaks; the model fits what is reached).

Sources, and how sure they are: Huawei publishes no per-SKU (910B1/B2/B3/B4) table in the Atlas 800T/900 A2
material this project could find; what circulates is third-party and disagrees (256, ~280, ~313, ~320, ~376, ~414
TFLOPS FP16 for "910B" depending on SKU and source). These are therefore **approximate public figures**, used only
for two things: the compute floor (FLOPs / peak) and for printing the fitted effective values as fractions of peak.
The model's predictions depend on the fitted effective values, not on these peaks.

* [PEAK-B] 910B FP16/BF16 peaks by SKU as commonly quoted: B1 ~414, B2 ~376, B3 ~313, B4 ~280 TFLOPS; third-party
  summaries, e.g. https://boardor.com/blog/huawei-ascend-910b-outperforms-h20-910c-approaches-h100 (~320 TFLOPS
  FP16, 64 GB HBM2e, "910B") and https://jishuzhan.net/article/1872432607539499010 (256 TFLOPS FP16 for an early
  910B). Not a Huawei datasheet.
* [HBM] 64 GB HBM2e at ~1.6 TB/s for 910B1-B3 (third-party; the same sources quote 0.4-1.6 TB/s: approximate).
* [HCCS] Atlas 800T A2: 8 NPUs fully connected by HCCS, 7 links x 56 GB/s = 392 GB/s per NPU (third-party; Huawei's
  MindCluster affinity pages describe the HCCS mesh, https://www.hiascend.com/document/detail/en/mindcluster/730/
  clustersched/schedulingug/dl_affinity_0040.html, without a figure). Per-collective latency: an assumption
  (:data:`HCCL_LATENCY_US`), no public figure found.
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
