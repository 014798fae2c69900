"""The ablation runner: what each optimization is worth, measured honestly (``vllm-omni-ascend-opt ablate``).

Modules: :mod:`.workload` (what to generate), :mod:`.plan` (which configurations), :mod:`.runner` (the run loop),
:mod:`.schedule` (interleaving: Williams orders, process sets, start order), :mod:`.processes` (a worker process and
its process group: pause, stop, CPU accounting), :mod:`.outdir` (the output directory, its lock, the measurement
log, resume), :mod:`.worker` (one configuration in its own process), :mod:`.engines` (its testbed / omni / serve
engines), :mod:`.protocol` (their line protocol), :mod:`.compare` (pixel / SSIM / PSNR equivalence), :mod:`.stats`
(noise floor, verdicts, exit code), :mod:`.report` (results.json, report.md, ablation.png), :mod:`.schema`
(results.json's shape), :mod:`.cli`. See docs/ablation.md.
"""
