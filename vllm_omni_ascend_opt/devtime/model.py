"""A device-time model of one Qwen-Image image on an Ascend 910B (a MODEL, calibrated, never a measurement).

Per op (``devtime/trace.py``)::

    time = max(FLOPs / effective peak of its kind, bytes / effective bandwidth of its kind) + launches x overhead
    image = steps x CFG forwards x transformer call + VAE decode + C

GEMMs and attention each get a peak, GEMMs their own bandwidth (``gemm_bw_eff``, for the weight-bound M = 1 ones);
``C`` (:attr:`Params.const_ms`) is what the trace does not cover (text encoder, scheduler, host gaps). :func:`fit`
calibrates the six parameters on :data:`FIT_POINTS` of :data:`REFERENCE_MS`, the rest held out, with a weak prior each
(:data:`PRIORS`). NZ weights and attention fusion change no FLOP or byte: the model sees only what they remove.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from vllm_omni_ascend_opt.devtime.costs import ATTENTION, GEMM
from vllm_omni_ascend_opt.devtime.int8 import GEMM_INT8, INT8_PEAK_RATIO
from vllm_omni_ascend_opt.devtime.specs import SPECS, DeviceSpec
from vllm_omni_ascend_opt.devtime.trace import OpTable

LABEL = "model, not measured"
#: The reference's published figures (910B1, BF16, eager, 1280x704, 8 steps, CFG off): configuration -> ms.
REFERENCE_MS: dict[str, float] = {
    "stock": 3111.5,
    "shared_modulation": 3111.5 - 255.0,
    "rope": 3111.5 - 194.0,
    "pixel": 2459.6,
    "pixel+vae": 2425.5,
    "default": 2280.0,
}
REFERENCE_STEPS = 8
REFERENCE_DEVICE = "910B1"
#: The calibration points the fit uses; the rest of :data:`REFERENCE_MS` is held out to check it.
FIT_POINTS = ("stock", "shared_modulation", "rope", "pixel")
#: (value, spread in log space, why): a weak prior per parameter (in :class:`Params` order).
PRIORS: dict[str, tuple[float, float, str]] = {
    "gemm_eff": (0.6, 0.5, "large bf16 GEMMs on a cube unit usually reach 50-70% of peak"),
    "attn_eff": (0.45, 0.5, "fused attention usually reaches less than GEMMs (softmax on the vector unit)"),
    "bw_eff": (0.6, 0.7, "element-wise kernels usually reach 50-80% of HBM bandwidth"),
    "gemm_bw_eff": (0.4, 1.0, "a GEMV (M = 1) streams its weights well below the element-wise bandwidth"),
    "launch_us": (10.0, 1.0, "eager torch_npu: ~10 us of device time per small kernel"),
    "const_ms": (150.0, 1.0, "Qwen2.5-VL-7B text encoder (~15 GB of weights read once) plus the pipeline's own work"),
}
_SIGMA_MS = 5.0  # weight of a calibration point: its ms residual over this


@dataclass(frozen=True)
class Params:
    gemm_eff: float
    attn_eff: float
    bw_eff: float
    gemm_bw_eff: float
    launch_us: float
    const_ms: float
    device: str = REFERENCE_DEVICE

    @property
    def spec(self) -> DeviceSpec:
        return SPECS[self.device]

    def describe(self) -> str:
        s = self.spec
        return (
            f"{s.name} ({s.source}): GEMM {self.gemm_eff * s.peak_tflops:.0f} TFLOPS ({self.gemm_eff:.0%} of "
            f"{s.peak_tflops:.0f}), attention {self.attn_eff * s.peak_tflops:.0f} TFLOPS ({self.attn_eff:.0%}), HBM "
            f"{self.bw_eff * s.hbm_gbps:.0f} GB/s ({self.bw_eff:.0%} of {s.hbm_gbps:.0f}; weight-bound GEMMs "
            f"{self.gemm_bw_eff * s.hbm_gbps:.0f} GB/s), {self.launch_us:.1f} us "
            f"per launch, C (text encoder and the untraced rest) {self.const_ms:.0f} ms"
        )

    def on(self, device: str) -> Params:
        """The same fractions of peak on another device."""
        return Params(**{**asdict(self), "device": device})


def op_ms(op: Any, p: Params) -> float:
    """Predicted device ms of one aggregated op (its ``count`` launches)."""
    s = p.spec
    peak = {GEMM: p.gemm_eff, ATTENTION: p.attn_eff, GEMM_INT8: p.gemm_eff * INT8_PEAK_RATIO}.get(op.kind)
    compute = op.flops / (peak * s.peak_tflops * 1e12) if peak else 0.0
    memory = op.bytes / ((p.gemm_bw_eff if op.kind in (GEMM, GEMM_INT8) else p.bw_eff) * s.hbm_gbps * 1e9)
    return (max(compute, memory) + op.count * p.launch_us * 1e-6) * 1e3


def call_ms(table: OpTable, p: Params) -> float:
    return sum(op_ms(op, p) for op in table.ops.values())


@dataclass(frozen=True)
class Prediction:
    transformer_ms: float  # one call
    image_ms: float
    floor_ms: float  # FLOPs / spec peak, the whole image's traced work


def predict(transformer: OpTable, vae: OpTable, p: Params, steps: int, cfg_forwards: int = 1) -> Prediction:
    """One image: ``steps x cfg_forwards`` transformer calls, one VAE decode, plus ``C``."""
    t, v = call_ms(transformer, p), call_ms(vae, p)
    flops = steps * cfg_forwards * transformer.flops + vae.flops
    floor = flops / (p.spec.peak_tflops * 1e12) * 1e3
    return Prediction(t, steps * cfg_forwards * t + v + p.const_ms, floor)


def _vectors(table: OpTable) -> tuple[np.ndarray, ...]:
    ops = list(table.ops.values())
    kind = np.array([0 if o.kind == GEMM else 1 if o.kind == ATTENTION else 2 for o in ops])
    return kind, *(np.array([getattr(o, f) for o in ops], dtype=float) for f in ("flops", "bytes", "count"))


def _fast_ms(vec: tuple[np.ndarray, ...], theta: np.ndarray, spec: DeviceSpec) -> float:
    kind, flops, nbytes, count = vec
    g, a, bw, gbw, launch_us = theta[:5]
    peak = np.where(kind == 0, g, np.where(kind == 1, a, np.inf)) * spec.peak_tflops * 1e12
    compute = flops / peak
    memory = nbytes / (np.where(kind == 0, gbw, bw) * spec.hbm_gbps * 1e9)
    return float((np.maximum(compute, memory) + count * launch_us * 1e-6).sum() * 1e3)


@dataclass
class Fit:
    params: Params
    #: configuration -> (published ms, model ms, residual ms, used in the fit)
    points: dict[str, tuple[float, float, float, bool]]

    def rows(self) -> list[str]:
        return [
            f"{name:<18} published {ref:7.1f}  model {got:7.1f}  residual {res:+6.1f} ms ({'fit' if used else 'held out'})"
            for name, (ref, got, res, used) in self.points.items()
        ]


def fit(calls: dict[str, tuple[OpTable, OpTable]], *, reference: dict[str, float] | None = None) -> Fit:
    """Fit :class:`Params` on :data:`FIT_POINTS` of ``reference``; ``calls``: configuration -> (transformer, VAE)."""
    from scipy.optimize import least_squares

    reference = reference or REFERENCE_MS
    spec = SPECS[REFERENCE_DEVICE]
    vecs = {n: (_vectors(t), _vectors(v)) for n, (t, v) in calls.items() if n in reference}

    def image(theta: np.ndarray, name: str) -> float:
        tv, vv = vecs[name]
        return REFERENCE_STEPS * _fast_ms(tv, theta, spec) + _fast_ms(vv, theta, spec) + theta[5]

    prior = np.array([value for value, _, _ in PRIORS.values()])
    spread = np.array([s for _, s, _ in PRIORS.values()])

    def residuals(log_theta: np.ndarray) -> np.ndarray:
        theta = np.exp(log_theta)
        data = [(image(theta, n) - reference[n]) / _SIGMA_MS for n in FIT_POINTS]
        return np.concatenate([data, (log_theta - np.log(prior)) / spread])

    bounds = (np.log([0.01, 0.01, 0.01, 0.01, 0.1, 1.0]), np.log([1.0, 1.0, 1.0, 1.0, 200.0, 3000.0]))
    got = least_squares(residuals, np.log(prior), bounds=bounds, x_scale="jac")
    theta = np.exp(got.x)
    params = Params(*(float(x) for x in theta))
    pts = {}
    for name, ref in reference.items():
        if name in vecs:
            m = image(theta, name)
            pts[name] = (ref, m, m - ref, name in FIT_POINTS)
    return Fit(params, pts)
