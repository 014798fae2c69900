"""vLLM-Omni's own NPU int8 (``vllm_omni/quantization/int8_config.py``: ``npu_dynamic_quant`` + ``npu_quant_matmul``)
on CPU, its platform check and ``torch_npu`` binding pointed at the NPU answer and the caller's fake."""

from __future__ import annotations

import importlib
import types
from typing import Any

import torch

from vllm_omni_ascend_opt.testbed.pipeline import load_pipeline

INT8_MODULE = "vllm_omni.quantization.int8_config"


def npu_int8(monkeypatch: Any, fake: types.ModuleType) -> types.ModuleType:
    """vLLM-Omni's int8 module, choosing its NPU methods and calling ``fake`` as torch_npu, for this test."""
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


def load_int8(runtime: Any, monkeypatch: Any, fake: types.ModuleType, ignored_layers: list[str] | None = None) -> Any:
    """The tiny pipeline in bf16 through vLLM-Omni's loader with ``--quantization int8`` (and ``ignored_layers``)."""
    from vllm_omni.quantization import build_quant_config

    npu_int8(monkeypatch, fake)
    spec = {"method": "int8", **({"ignored_layers": ignored_layers} if ignored_layers else {})}
    return load_pipeline(runtime, dtype=torch.bfloat16, quantization_config=build_quant_config(spec))


def int8_layers(transformer: torch.nn.Module) -> list[str]:
    """Names of the linears running vLLM-Omni's NPU int8 method."""
    method = importlib.import_module(INT8_MODULE).NPUInt8LinearMethod
    return [n for n, m in transformer.named_modules() if isinstance(getattr(m, "quant_method", None), method)]
