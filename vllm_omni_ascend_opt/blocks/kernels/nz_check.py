"""The FRACTAL_NZ weight checks ``nz_weights`` runs before it casts anything: the torch_npu / CANN gate, the trial
cast that establishes permission, and the numerical check of ``F.linear`` with an NZ weight against the ND weight.
Sources ([OP-FMT] format codes, [TNPU-CFG] write-only ``allow_internal_format``, [VA-3356] the CANN 8.3 WeightNz
routing) are cited in ``tests/fake_torch_npu/formats.py``.
"""

from __future__ import annotations

import re
from types import ModuleType
from typing import Any

import torch

from vllm_omni_ascend_opt import _backend
from vllm_omni_ascend_opt.blocks.kernels import saved, timing
from vllm_omni_ascend_opt.blocks.kernels.verdicts import Verdict
from vllm_omni_ascend_opt.blocks.kernels.verified import Candidate, KernelPath

ACL_FORMAT_ND = 2  # [OP-FMT]
ACL_FORMAT_FRACTAL_NZ = 29  # [OP-FMT]
#: CANN from which ND x NZ linear/addmm/matmul run the WeightNz kernels [VA-3356].
MIN_CANN = (8, 3)
#: torch_npu line carrying op-plugin 7.2 (our reading, not documented).
MIN_TORCH_NPU = (2, 8)
#: Numerical check: |nz - nd| <= K * eps(dtype) * (|x| @ |w|^T + |b|), K = 2. Two correct results (fp32 accumulation,
#: one rounding each) differ by at most 2u = eps of that sum; K = 2 doubles it. A layout misread errs by O(sum).
NUMERIC_EPS_FACTOR = 2.0


def _version_tuple(text: str) -> tuple[int, ...] | None:
    """Leading numeric fields of a version string: "8.3.RC1" -> (8, 3); "2.13.0+fake" -> (2, 13, 0)."""
    m = re.match(r"\d+(?:\.\d+)*(?=\.|$)", str(text).replace("+", "."))
    return tuple(map(int, m.group().split("."))) if m else None


def version_reasons(npu: ModuleType) -> list[str]:
    """Why this torch_npu / CANN pair does not route ND x NZ matmuls to the WeightNz kernels ([] when it does)."""
    tnpu = str(getattr(npu, "__version__", "?"))
    cann = _backend.cann_version()
    reasons = []
    cann_t = _version_tuple(cann) if cann else None
    if cann_t is None:
        reasons.append(f"CANN version unknown (torch.npu.utils.get_cann_version() gave {cann!r}; torch_npu {tnpu})")
    elif cann_t[:2] < MIN_CANN:
        reasons.append(
            f"CANN {cann} < {'.'.join(map(str, MIN_CANN))}: F.linear/addmm with an NZ weight does not reach "
            f"aclnnMatmulWeightNz/aclnnAddmmWeightNz before CANN 8.3 (vllm-ascend PR #3356; torch_npu {tnpu})"
        )
    tnpu_t = _version_tuple(tnpu)
    if tnpu_t is None or tnpu_t[:2] < MIN_TORCH_NPU:
        reasons.append(
            f"torch_npu {tnpu} < {'.'.join(map(str, MIN_TORCH_NPU))}: no op-plugin 7.2 WeightNz routing (CANN {cann})"
        )
    return reasons


def trial_cast(npu: ModuleType, w_nd: torch.Tensor) -> tuple[torch.Tensor | None, str]:
    """Cast ``w_nd`` to FRACTAL_NZ: (the NZ tensor, "") or (None, why not). ``allow_internal_format`` is write-only
    [TNPU-CFG]: a cast that raises or comes back in another format means internal formats are not allowed here."""
    try:
        nz = npu.npu_format_cast(w_nd, ACL_FORMAT_FRACTAL_NZ)
        fmt = npu.get_npu_format(nz)
    except Exception as exc:
        return None, (
            f"trial npu_format_cast(w, {ACL_FORMAT_FRACTAL_NZ}) raised {exc.__class__.__name__}: {exc} (internal "
            "formats not allowed? torch.npu.config.allow_internal_format is write-only and cannot be read back)"
        )
    if fmt != ACL_FORMAT_FRACTAL_NZ:
        return None, (
            f"trial npu_format_cast(w, {ACL_FORMAT_FRACTAL_NZ}) gave format {fmt}: internal formats not allowed "
            "(torch.npu.config.allow_internal_format = False, the default on Atlas A3)"
        )
    return nz, ""


#: The saved NZ GEMM timings (key: device, dtype, n, k, rows), read by ``devtime/measured.py`` too; the int8 ones are
#: ``FRACTAL_NZ int8 weight.timing`` (key: device, "int8", k, n, rows).
NZ_TIMING = "FRACTAL_NZ linear.timing"
#: The NZ check's GEMM at production rows: at most this many rows, and at most CHECK_ELEMS elements per operand.
PRODUCTION_ROWS = 4096
CHECK_ELEMS = 1 << 24


def check_nz_linear(w_nd: torch.Tensor, w_nz: torch.Tensor) -> tuple[bool, str]:
    """``F.linear`` with the NZ weight against the ND weight at the real weight shape, 3-D with and without bias and at
    up to :data:`PRODUCTION_ROWS` rows: (ok, detail)."""
    n, k = w_nd.shape
    g = torch.Generator().manual_seed(0x4E5A)
    x = torch.randn(2, 7, k, generator=g).to(device=w_nd.device, dtype=w_nd.dtype)
    b = (torch.randn(n, generator=g) * 0.5).to(device=w_nd.device, dtype=w_nd.dtype)
    rows = max(16, min(PRODUCTION_ROWS, CHECK_ELEMS // max(n, k)))
    xp = torch.randn(1, rows, k, generator=g).to(device=w_nd.device, dtype=w_nd.dtype)
    worst = []
    cases = (("3-D addmm with bias", x, b), ("3-D matmul without bias", x, None), (f"{rows} rows with bias", xp, b))
    for case, x, bias in cases:
        try:
            got = torch.nn.functional.linear(x, w_nz, bias)
        except Exception as exc:
            return False, f"{case} with the NZ weight raised {exc.__class__.__name__}: {exc}"
        want = torch.nn.functional.linear(x, w_nd, bias)
        scale = torch.matmul(x.float().abs(), w_nd.float().abs().t()) + (0 if bias is None else bias.float().abs())
        bound = NUMERIC_EPS_FACTOR * torch.finfo(x.dtype).eps * scale + torch.finfo(torch.float32).tiny
        ratio = float(((got.float() - want.float()).abs() / bound).max())
        if not ratio <= 1.0:  # NaN fails too
            return False, (
                f"{case}: NZ result differs from the ND weight's by up to {ratio:.3g}x the tolerance "
                f"{NUMERIC_EPS_FACTOR:g}*eps*(|x|@|w|^T+|b|) (weight {n}x{k})"
            )
        worst.append(f"{case} {ratio:.3g}x")
    return True, f"{', '.join(worst)} of the tolerance (weight {n}x{k})"


class NzPath(KernelPath):
    """FRACTAL_NZ linear weights: the first-use numbers per (device, dtype) and the guard the all-or-nothing cast
    runs under; kept in memory (a cast is decided once per load)."""

    kernel = "FRACTAL_NZ linear"
    candidates = (Candidate("npu_format_cast", "close"),)
    persist = False

    def __init__(self, label: str, stats: Any) -> None:
        super().__init__(label, stats)
        #: per (device, dtype, n, k): the NZ GEMM's timing against ND at production rows (:meth:`slower`)
        self.timed: dict[tuple, dict[str, Any]] = {}

    def slower(self, w_nd: torch.Tensor, w_nz: torch.Tensor, module: torch.nn.Module | None = None) -> str:
        """Why the NZ GEMM is not kept ("slower: ..."), or "" where it beats ND by the margin at production rows
        (timed once per weight shape, ND first, then NZ, and saved as ``<kernel>.timing``); "" with timing off."""
        if not timing.enabled():
            return ""
        rows = max(16, min(PRODUCTION_ROWS, CHECK_ELEMS // max(w_nd.shape)))
        key = (str(w_nd.device), str(w_nd.dtype).removeprefix("torch."), *w_nd.shape, rows)
        if key not in self.timed:
            hit = saved.lookup(self.kernel + ".timing", key)
            if hit is None or hit[2] is None:
                gemm = self.gemm(w_nd, rows, module)
                nd = timing.measure(lambda: gemm(w_nd), w_nd.device)
                nz = timing.measure(lambda: gemm(w_nz), w_nd.device)
                hit = (True, "timed", timing.report({self.candidates[0].name: nz}, nd, [self.candidates[0].name]))
                self.stats["timings"] += 2
                saved.save(self.kernel + ".timing", key, True, "timed", hit[2])
            self.timed[key] = hit[2]
        return "" if self.timed[key]["candidate"] else timing.slower(self.timed[key])

    def gemm(self, w_nd: torch.Tensor, rows: int, module: torch.nn.Module | None) -> Any:
        """The GEMM :meth:`slower` times, as a function of the weight: ``F.linear`` of ``rows`` random rows."""
        x = torch.randn(1, rows, w_nd.shape[1], generator=torch.Generator().manual_seed(0x4E5A))
        x = x.to(w_nd.device, w_nd.dtype)
        return lambda w: torch.nn.functional.linear(x, w)

    def clear(self) -> None:
        super().clear()
        self.timed.clear()

    def check(self, w_nd: torch.Tensor, w_nz: torch.Tensor) -> Verdict:
        key = (str(w_nd.device), str(w_nd.dtype).removeprefix("torch."))
        return self.verdict(key, *check_nz_linear(w_nd, w_nz))


def is_npu_int8(module: torch.nn.Module) -> bool:
    """Whether ``module`` runs vLLM-Omni's NPU int8 (``npu_dynamic_quant`` + ``npu_quant_matmul``, int8 ``[k, n]``)."""
    return any(c.__name__ == "NPUInt8LinearMethod" for c in type(getattr(module, "quant_method", None)).__mro__)


def check_nz_quant_matmul(npu: ModuleType, module: torch.nn.Module, w_nz: torch.Tensor) -> tuple[bool, str]:
    """``npu_quant_matmul`` with the NZ weight against the ND one at this weight shape, with and without bias and at
    a few row counts: int32 accumulation is exact, so the results must be bit for bit the same: (ok, detail)."""
    w_nd, scale, bias = module.weight.data, module.weight_scale.data, getattr(module, "bias", None)
    k, n = w_nd.shape
    dtype = getattr(module, "orig_dtype", torch.bfloat16)
    g = torch.Generator().manual_seed(0x4E5A)
    for rows in (1, 7, 64):
        x = torch.randn(rows, k, generator=g).to(device=w_nd.device, dtype=dtype)
        qx, s = npu.npu_dynamic_quant(x)
        for b in (bias, None):
            kw = dict(bias=b, pertoken_scale=s, output_dtype=dtype)
            try:
                got = npu.npu_quant_matmul(qx, w_nz, scale, **kw)
            except Exception as exc:
                return False, f"npu_quant_matmul with an NZ int8 weight {k}x{n} raised {exc.__class__.__name__}: {exc}"
            if not torch.equal(got, npu.npu_quant_matmul(qx, w_nd, scale, **kw)):
                return False, f"npu_quant_matmul with the NZ int8 weight {k}x{n} is not bitwise the ND result"
    return True, f"bitwise the ND result (int8 weight {k}x{n}, 1/7/64 rows, with and without bias)"


class NzInt8Path(NzPath):
    """FRACTAL_NZ int8 weights of vLLM-Omni's NPU int8 linears: one bitwise check per weight shape, then the
    ``npu_quant_matmul`` timing of NZ against ND (:meth:`gemm`)."""

    kernel = "FRACTAL_NZ int8 weight"
    candidates = (Candidate("npu_format_cast", "exact"),)

    def gemm(self, w_nd: torch.Tensor, rows: int, module: torch.nn.Module | None) -> Any:
        """vLLM-Omni's NPU int8 ``apply``: ``npu_quant_matmul`` with its arguments, on ``rows`` random activations
        quantized once by ``npu_dynamic_quant`` (the same for ND and NZ, so outside the timed calls)."""
        npu, dtype = _backend.torch_npu_module(), getattr(module, "orig_dtype", torch.bfloat16)
        x = torch.randn(rows, w_nd.shape[0], generator=torch.Generator().manual_seed(0x4E5A)).to(w_nd.device, dtype)
        qx, s = npu.npu_dynamic_quant(x)
        scale, bias = module.weight_scale, getattr(module, "bias", None)  # type: ignore[union-attr]
        return lambda w: npu.npu_quant_matmul(qx, w, scale, bias=bias, pertoken_scale=s, output_dtype=dtype)

    def check_int8(self, npu: ModuleType, module: torch.nn.Module, w_nz: torch.Tensor) -> Verdict:
        key = (str(w_nz.device), "int8", *w_nz.shape)
        ok, detail = check_nz_quant_matmul(npu, module, w_nz)
        return self.verdict(key, ok, detail, bitwise=ok)
