"""The ablation runner (``vllm-omni-ascend-opt ablate``): what each optimization is worth; see docs/ablation.md."""
