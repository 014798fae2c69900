"""The ablation runner: what each optimization is worth, measured honestly (``vllm-omni-ascend-opt ablate``); see
docs/ablation.md. Each module's docstring says its part: workload -> plan -> runner (schedule, processes, outdir,
worker, engines) -> stats, stages, verdict -> report."""
