"""``make demo`` until the ablation runner lands: one tiny generation on CPU with the default stack."""

from __future__ import annotations

import time

from vllm_omni_ascend_opt import _plugin, api


def main() -> int:
    t0 = time.perf_counter()
    from vllm_omni_ascend_opt.testbed import build_model_dir
    from vllm_omni_ascend_opt.testbed.pipeline import generate, load_pipeline
    from vllm_omni_ascend_opt.testbed.runtime import init_cpu_runtime

    _plugin.register()
    model_dir = build_model_dir()
    rt = init_cpu_runtime(str(model_dir))
    pipe = load_pipeline(rt)
    res = generate(pipe, rt, "a red cat", height=64, width=64, steps=4, seed=42, cfg_scale=1.0)
    print(f"\ntiny Qwen-Image ({model_dir}) -> images {tuple(res.images.shape)} in {res.stage_ms['total']:.0f} ms")
    for row in api.status():
        state = "active" if row["active"] else "inactive: " + "; ".join(row["reasons_inactive"])
        print(f"  {row['name']:<18} {state}")
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
