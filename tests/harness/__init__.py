"""Test-only harnesses: the gloo parallel-mode workers, the tiny Qwen-Image-2.1 model and LoRA adapters for the
tests, built on the test bed (``vllm_omni_ascend_opt.testbed``) but not shipped with the plugin."""
