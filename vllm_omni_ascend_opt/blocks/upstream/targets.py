"""Upstream modules the optimizations patch, and the upstream functions several of them declare (in their
``upstream`` tables), written once. ``python tools/fingerprints.py`` prints the installed release's fingerprints."""

from vllm_omni_ascend_opt.blocks.upstream.fingerprints import ABSENT, ALL, Upstream, same

TRANSFORMER = "vllm_omni.diffusion.models.qwen_image.qwen_image_transformer"
PIPELINE = "vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image"
DIST_VAE = "vllm_omni.diffusion.distributed.autoencoders.autoencoder_kl_qwenimage"
DIFFUSERS_VAE = "diffusers.models.autoencoders.autoencoder_kl_qwenimage"
SDPA_BACKEND = "vllm_omni.diffusion.attention.backends.sdpa"
ATTENTION_LAYER = "vllm_omni.diffusion.attention.layer"
ADALAYERNORM = "vllm_omni.diffusion.layers.adalayernorm"
CUSTOM_OP = "vllm_omni.diffusion.layers.custom_op"
ROTARY = "vllm_omni.diffusion.layers.rope"
FUSED_QK_NORM_ROPE = "vllm_omni.diffusion.layers.fused_qk_norm_rope"
LOADER = "vllm_omni.diffusion.model_loader.diffusers_loader"

#: The block forward: shared_modulation replaces it (its block body mirrors it), the fast tier modes live in it.
BLOCK_FORWARD = same(TRANSFORMER, "QwenImageTransformerBlock.forward", "8177c846de52aa4e")
#: AdaLayerNorm's native path (``LN(x) * (1 + scale) + shift``): mirrored by the memo's block body and fast_modulate.
ADA_FORWARD_NATIVE = same(ADALAYERNORM, "AdaLayerNorm.forward_native", "bfc59b1498c56a60")
#: AdaLayerNorm's NPU path (``npu_layer_norm_eval`` without MindIE-SD): mirrored on Ascend.
ADA_FORWARD_NPU = same(ADALAYERNORM, "AdaLayerNorm.forward_npu", "ec9099f9e734847b", ("npu",))
#: Where the QK norms and RoPE run: rope patches it, joint_attention replaces it, qk_norm's norms are called there.
QK_NORM_ROPE = same(TRANSFORMER, "_qwen_image_qk_norm_rope", "42c867aca9afff60")
#: The joint attention forward: joint_attention replaces it; fused_attention relies on its per-block joint mask.
CROSS_ATTENTION_FORWARD = same(TRANSFORMER, "QwenImageCrossAttention.forward", "5c732dbcbeb18e75")
#: The QK norms' and projections' construction (nn.RMSNorm over head_dim, one per stream).
CROSS_ATTENTION_INIT = same(TRANSFORMER, "QwenImageCrossAttention.__init__", "8841719130c44be1")
#: Stock's fused CUDA qk-norm-rope branch condition, mirrored so that it stays stock's.
FUSED_MIN_TOKENS = same(FUSED_QK_NORM_ROPE, "fused_qk_norm_rope_min_tokens", "9d374eb901ba1db5")
FUSED_CUDA_SUPPORTED = same(FUSED_QK_NORM_ROPE, "_fused_cuda_supported", "62e2ef087f307578")
#: vLLM-Omni's native rotary math (the portable path is bitwise it) and its NPU dispatch (falls back to it).
ROTARY_FORWARD_NATIVE = same(ROTARY, "RotaryEmbedding.forward_native", "7f423b211c805b58")
ROTARY_FORWARD_NPU = same(ROTARY, "RotaryEmbedding.forward_npu", "768c84ac16662774", ("npu",))
#: diffusers' Qwen-Image VAE pieces both VAE optimizations patch per instance.
VAE_DECODE = same(DIFFUSERS_VAE, "AutoencoderKLQwenImage._decode", "aa21d785622137b6")
CAUSAL_CONV_FORWARD = same(DIFFUSERS_VAE, "QwenImageCausalConv3d.forward", "d2679e72119a1c8e")
CAUSAL_CONV_INIT = same(DIFFUSERS_VAE, "QwenImageCausalConv3d.__init__", "5644f56f54eaca26")
#: The loader's load_model: the plugin attaches after it returns (weights processed, before offload is enabled).
LOAD_MODEL = same(LOADER, "DiffusersPipelineLoader.load_model", "d13c38b93708077e")

EMBEDDINGS = "diffusers.models.embeddings"
#: Qwen-Image's timestep embedding and what it runs: the memo keys their output on the timestep's value.
TIME_EMBEDDING = (
    same(TRANSFORMER, "QwenTimestepProjEmbeddings.forward", "e127246f041ab288"),
    same(EMBEDDINGS, "TimestepEmbedding.forward", "7a64747c1e8ed70d"),
    same(EMBEDDINGS, "Timesteps.forward", "58794175acc7b12d"),
    same(EMBEDDINGS, "get_timestep_embedding", "6028d48c06ba9784"),
    same("torch.nn.modules.sparse", "Embedding.forward", "612a591ba15b23d2"),
)

LINEAR = "vllm.model_executor.layers.linear"
LINEAR_UTILS = "vllm.model_executor.layers.utils"
PARAMETER = "vllm.model_executor.parameter"
NORM = "vllm_omni.diffusion.layers.norm"
#: What the direct calls mirror: vLLM's plain linears down to their GEMM, vLLM-Omni's FeedForward and layer norms.
DIRECT_CALLS = (
    same(LINEAR, "ReplicatedLinear.forward", "0509484a019dc9a6"),
    same(LINEAR, "ColumnParallelLinear.forward", "a83e0a998236fbef"),
    Upstream(LINEAR, "QKVParallelLinear.forward", {ABSENT: ALL}),  # inherits ColumnParallelLinear's
    same(LINEAR, "RowParallelLinear.forward", "6f282baaa162ded9"),
    same(LINEAR, "UnquantizedLinearMethod.apply", "849ee397279b9b72"),
    same(LINEAR_UTILS, "default_unquantized_gemm", "046576d5cfcb9a40"),
    same(PARAMETER, "BasevLLMParameter.__torch_function__", "93ab4e0b466afb93"),
    same(TRANSFORMER, "FeedForward.forward", "c600e6f33fe6119a"),
    same(TRANSFORMER, "ColumnParallelApproxGELU.forward", "3433c7a2c2700355"),
    same("torch.nn.modules.normalization", "LayerNorm.forward", "29d655f9844bd1d5"),
    same(NORM, "LayerNorm.forward", "f5141956f3353fa0"),
    same(NORM, "LayerNorm.forward_native", "aeccdfbbc9f7927b"),
    same(NORM, "LayerNorm.forward_cuda", "afe38032434620d2"),
    same(NORM, "LayerNorm.forward_hip", "c351562493d6e6de"),
    same(NORM, "LayerNorm.forward_npu", "42aaeca4199b5577"),
)
