"""CPU test bed: a tiny, offline, seeded Qwen-Image, a minimal CPU runtime for vLLM-Omni 0.30, and a runner.

Used by the tests, ``make demo`` and the ablation runner. Nothing here is imported by :func:`register`; the CPU
runtime changes vLLM-Omni only when you call :func:`init_cpu_runtime` and only when no accelerator platform exists.
"""

from vllm_omni_ascend_opt.testbed.tiny_model import REALWIDTH, TINY, TINY_FAMILY, build_model_dir

__all__ = ["REALWIDTH", "TINY", "TINY_FAMILY", "build_model_dir"]
