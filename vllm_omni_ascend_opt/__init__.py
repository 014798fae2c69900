"""vllm-omni-ascend-opt: swappable Ascend NPU optimizations for vLLM-Omni's Qwen-Image.

Loaded by vLLM-Omni in every process through the ``vllm_omni.general_plugins`` entry point (``register``).
Importing this package is cheap: it does not import torch_npu, vLLM or vLLM-Omni.
"""

from __future__ import annotations

from vllm_omni_ascend_opt._plugin import PluginConfigError, register
from vllm_omni_ascend_opt._version import __version__
from vllm_omni_ascend_opt.api import (
    apply_to_qwen_image,
    disable,
    enable,
    installed,
    optimizations,
    select,
    status,
)
from vllm_omni_ascend_opt.flags import FlagError

__all__ = [
    "FlagError",
    "PluginConfigError",
    "__version__",
    "apply_to_qwen_image",
    "disable",
    "enable",
    "installed",
    "optimizations",
    "register",
    "select",
    "status",
]
