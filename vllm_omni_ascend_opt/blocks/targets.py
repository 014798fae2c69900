"""Upstream module names the optimizations patch (vLLM-Omni 0.30.x, diffusers 0.40.x)."""

TRANSFORMER = "vllm_omni.diffusion.models.qwen_image.qwen_image_transformer"
PIPELINE = "vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image"
DIST_VAE = "vllm_omni.diffusion.distributed.autoencoders.autoencoder_kl_qwenimage"
DIFFUSERS_VAE = "diffusers.models.autoencoders.autoencoder_kl_qwenimage"
SDPA_BACKEND = "vllm_omni.diffusion.attention.backends.sdpa"
