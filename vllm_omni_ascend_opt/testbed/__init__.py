"""CPU test bed: a tiny, offline, seeded Qwen-Image, a minimal CPU runtime for vLLM-Omni 0.30, and a runner.

Never imported by :func:`register`; the CPU runtime acts only when called and only without an accelerator platform.
"""

from vllm_omni_ascend_opt.testbed.tiny_model import REALWIDTH, TINY, TINY_FAMILY, build_model_dir

__all__ = ["REALWIDTH", "TINY", "TINY_FAMILY", "build_model_dir"]
