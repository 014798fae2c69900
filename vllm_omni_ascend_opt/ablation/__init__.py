"""The ablation runner: what each optimization is worth, measured honestly (``vllm-omni-ascend-opt ablate``).

Modules: :mod:`.workload` (what to generate), :mod:`.plan` (which configurations), :mod:`.runner` (worker processes,
interleaving, resume), :mod:`.worker` (one configuration in its own process), :mod:`.protocol` (their line
protocol), :mod:`.compare` (pixel / SSIM / PSNR equivalence), :mod:`.stats` (noise floor, verdicts, exit code),
:mod:`.report` (results.json, report.md, ablation.png), :mod:`.schema` (results.json's shape), :mod:`.cli`.
See docs/ablation.md.
"""
