"""vLLM-Omni's own NPU int8 (``vllm_omni/quantization/int8_config.py``) on CPU: its online method quantizes the bf16
weights at load with ``torch_npu.npu_dynamic_quant`` and runs each linear as ``npu_dynamic_quant`` +
``npu_quant_matmul``. The module picks its methods by ``current_omni_platform.is_npu()`` and binds ``torch_npu`` at
import; :func:`npu_int8` points both at the NPU answer and the caller's fake for one test."""

from __future__ import annotations

import types
from typing import Any

import torch

from vllm_omni_ascend_opt.testbed.pipeline import load_pipeline

INT8_MODULE = "vllm_omni.quantization.int8_config"


def npu_int8(monkeypatch: Any, fake: types.ModuleType) -> types.ModuleType:
    """vLLM-Omni's int8 module, choosing its NPU methods and calling ``fake`` as torch_npu, for this test."""
    import importlib

    ic = importlib.import_module(INT8_MODULE)
    real = ic.current_omni_platform

    class _Npu:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def is_npu(self) -> bool:
            return True

        def is_cuda(self) -> bool:
            return False

    monkeypatch.setattr(ic, "current_omni_platform", _Npu())
    monkeypatch.setattr(ic, "torch_npu", fake)
    return ic


def int8_config(ignored_layers: list[str] | None = None) -> Any:
    """``--quantization int8`` as vLLM-Omni builds it (optionally with ``ignored_layers``)."""
    from vllm_omni.quantization import build_quant_config

    spec: dict[str, Any] = {"method": "int8"}
    if ignored_layers:
        spec["ignored_layers"] = ignored_layers
    return build_quant_config(spec)


def load_int8(runtime: Any, monkeypatch: Any, fake: types.ModuleType, **kw: Any) -> Any:
    """The tiny pipeline in bf16 through vLLM-Omni's loader with its NPU int8 (``kw``: :func:`int8_config`)."""
    npu_int8(monkeypatch, fake)
    return load_pipeline(runtime, dtype=torch.bfloat16, quantization_config=int8_config(**kw))


def int8_layers(transformer: torch.nn.Module) -> list[str]:
    """Names of the linears running vLLM-Omni's NPU int8 method."""
    import importlib

    ic = importlib.import_module(INT8_MODULE)
    return [
        n
        for n, m in transformer.named_modules()
        if isinstance(getattr(m, "quant_method", None), ic.NPUInt8LinearMethod)
    ]
