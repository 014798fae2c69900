#!/usr/bin/env python
"""Host->device bytes per warm denoise step under vLLM-Omni's layerwise offload: stock vs default, in ONE run.

Usage (from the repo root, after `make venv`)::

    .venv/bin/python benchmarks/bench_offload.py            # tiny (2 and 60 blocks) + real width (2 blocks)
    .venv/bin/python benchmarks/bench_offload.py --quick    # tiny, 2 blocks
    .venv/bin/python benchmarks/bench_offload.py --json out.json

What it does: for each model (the test bed's tiny Qwen-Image at 2 blocks and at the real model's 60 blocks; the real
width -- hidden 3072, 24 heads x 128, random weights -- at 2 blocks, fp32), one worker process loads it through
vLLM-Omni's own ``DiffusionModelRunner`` with ``enable_layerwise_offload`` (``pin_cpu_memory=False`` on CPU) once per
configuration, runs a request (cold), then the same request again (warm) and counts the bytes copied out of the
offloader's host weights during the warm one (``vllm_omni_ascend_opt/testbed/offload.py``: counted on the copies).
Per configuration it prints the bytes per denoise step (2 transformer forwards with CFG), the ratio to stock measured
in the same run, the memo's hits and misses on the warm request, the forwards ``memo_aware_offload`` let skip the
modulation weights, and whether the image is stock's bit for bit.

Configurations: ``stock`` (none); ``storage-key``: the default stack with the memo's weight signature keyed on device
storage as it was before issue 21's re-key (the offloader renews it every forward: the "before" of the memo's hits
under offload); ``default-mao``: the default stack without ``memo_aware_offload`` (``default,-memo_aware_offload``:
the re-keyed memo hits, every weight is still copied); ``default``: the default stack (``memo_aware_offload`` is in
it and leaves the modulation weights of blocks 1..N-1 on the host when the memo holds them all).

Depth: the ring copies every block once per forward, and block 0 (prefetched during the previous forward, before its
``temb`` exists) always whole, so with N blocks of B bytes, M of them modulation: stock copies N*B per forward, a
skipping forward N*B - (N-1)*M. The 60-block tiny model measures that at the real depth; the real-width row at
2 blocks is projected to 60 blocks with the same formula from its measured B and M (exact: every block has the same
weights).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
#: name -> (base spec, blocks, dtype, image size)
MODELS: dict[str, tuple[str, int, str, int]] = {
    "tiny-2": ("tiny", 2, "fp32", 32),
    "tiny-60": ("tiny", 60, "fp32", 32),
    "realwidth-2": ("realwidth", 2, "fp32", 64),  # fp32: the runner path does not cast the test bed text encoder
}
#: config -> selection spec
CONFIGS: dict[str, str] = {
    "stock": "none",
    "storage-key": "default",
    "default-mao": "default,-memo_aware_offload",
    "default": "default",
}
STEPS, CFG = 2, 4.0
REAL_DEPTH = 60


@contextlib.contextmanager
def storage_keyed_memo() -> Any:
    """The memo's weight signature with each weight's ``data_ptr`` added: what it keyed on before issue 21."""
    from vllm_omni_ascend_opt.blocks.memo import keys as modulation_keys

    real = modulation_keys.tensor_state  # the per-call half of every weight signature

    def storage_state(tensors: Any, grad: bool) -> tuple[Any, ...]:
        return (*real(tensors, grad), *(t.data_ptr() for t in tensors))

    modulation_keys.tensor_state = storage_state
    try:
        yield
    finally:
        modulation_keys.tensor_state = real


def child(name: str) -> dict[str, Any]:
    import dataclasses

    import torch

    from vllm_omni_ascend_opt import api, registry
    from vllm_omni_ascend_opt.blocks.upstream.layerwise import is_modulation, layerwise_hooks
    from vllm_omni_ascend_opt.testbed import REALWIDTH, TINY, build_model_dir
    from vllm_omni_ascend_opt.testbed.model_runner import RunnerHarness
    from vllm_omni_ascend_opt.testbed.offload import count_offload_copies
    from vllm_omni_ascend_opt.testbed.runtime import init_cpu_runtime

    base, blocks, dtype, size = MODELS[name]
    torch.set_num_threads(os.cpu_count() or 1)
    spec = {"tiny": TINY, "realwidth": REALWIDTH}[base]
    if blocks != spec.num_layers:
        spec = dataclasses.replace(spec, name=f"{spec.name}{blocks}blocks", num_layers=blocks)
    rt = init_cpu_runtime(str(build_model_dir(spec)), dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
    sm, mao = registry.get("shared_modulation"), registry.get("memo_aware_offload")
    request = {"height": size, "width": size, "steps": STEPS, "cfg_scale": CFG}
    rows, images, block_bytes, mod_bytes = [], {}, 0, 0
    for config in CONFIGS:
        api.select(CONFIGS[config])
        with storage_keyed_memo() if config == "storage-key" else contextlib.nullcontext():
            h = RunnerHarness.load(rt, enable_layerwise_offload=True)
            try:
                h.generate(**request)  # cold: fills the memo
                for opt in registry.all_optimizations():
                    opt.reset_stats()
                with count_offload_copies(h.pipeline) as copies:
                    images[config] = h.generate(**request)
                hook = layerwise_hooks(h.pipeline.transformer)[0]
                metas = [
                    (m, t.element_size())
                    for d, t in hook.dtype_cpu_flattened_weights.items()
                    for m in hook.dtype_metadata[d]
                ]
                block_bytes = sum(m["numel"] * s for m, s in metas)
                mod_bytes = sum(m["numel"] * s for m, s in metas if is_modulation(m["name"]))
                rows.append(
                    {
                        "config": config,
                        "bytes_per_step": copies.bytes / STEPS,
                        "memo_hits": sm.stats.get("hits", 0),
                        "memo_misses": sm.stats.get("misses", 0),
                        "forwards_skipping": mao.stats.get("forwards_skipping", 0),
                        "forwards_copying": mao.stats.get("forwards_copying", 0),
                        "identical_to_stock": bool(torch.equal(images[config], images["stock"])),
                    }
                )
            finally:
                h.close()
                api.select("none")
    return {
        "model": name,
        "blocks": blocks,
        "dtype": dtype,
        "block_bytes": block_bytes,
        "mod_bytes": mod_bytes,
        "rows": rows,
    }


def projected_ratio(block_bytes: int, mod_bytes: int, blocks: int) -> float:
    """Bytes of a skipping forward over stock's with ``blocks`` blocks (block 0 always copied whole)."""
    return (blocks * block_bytes - (blocks - 1) * mod_bytes) / (blocks * block_bytes)


def report(results: list[dict[str, Any]]) -> str:
    lines = [
        f"host->device bytes per warm denoise step under layerwise offload ({STEPS} steps, CFG {CFG}: 2 forwards "
        "per step), counted on the copies out of the offloader's host weights",
    ]
    hdr = (
        f"{'model':<12} {'blocks':>6} {'config':<12} {'MiB/step':>10} {'x stock':>8} {'memo hit/miss':>14} "
        f"{'fwd skip/copy':>14}  identical"
    )
    for res in results:
        lines += ["", hdr, "-" * len(hdr)]
        stock = next(r for r in res["rows"] if r["config"] == "stock")["bytes_per_step"]
        for r in res["rows"]:
            lines.append(
                f"{res['model']:<12} {res['blocks']:>6} {r['config']:<12} {r['bytes_per_step'] / 2**20:>10.2f} "
                f"{r['bytes_per_step'] / stock:>8.3f} {r['memo_hits']:>7}/{r['memo_misses']:<6} "
                f"{r['forwards_skipping']:>7}/{r['forwards_copying']:<6}  {'yes' if r['identical_to_stock'] else 'no'}"
            )
        b, m = res["block_bytes"], res["mod_bytes"]
        lines.append(
            f"  one block {b / 2**20:.2f} MiB, of which img_mod/txt_mod {m / 2**20:.2f} MiB ({m / b:.3f}); a "
            f"skipping forward copies {projected_ratio(b, m, res['blocks']):.3f}x stock at {res['blocks']} blocks, "
            f"{projected_ratio(b, m, REAL_DEPTH):.3f}x at {REAL_DEPTH} (N*B - (N-1)*M over N*B)"
        )
    lines += [
        "",
        "storage-key: the default stack with the memo keyed on device storage (before issue 21's re-key);",
        "default-mao: default,-memo_aware_offload (the re-keyed memo hits; every weight still copied);",
        "default: the default stack (memo_aware_offload leaves img_mod/txt_mod of blocks 1..N-1 on the host).",
    ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help="comma list of: " + ", ".join(MODELS))
    ap.add_argument("--quick", action="store_true", help="tiny-2 only")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("BENCH_JSON " + json.dumps(child(args.child)))
        return 0
    models = ["tiny-2"] if args.quick else [m.strip() for m in args.models.split(",") if m.strip()]
    results, t0 = [], time.perf_counter()
    for m in models:
        if m not in MODELS:
            ap.error(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
        print(f"[bench_offload] {m}: running ...", flush=True)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        proc = subprocess.run(
            [sys.executable, __file__, "--child", m], capture_output=True, text=True, cwd=REPO, env=env
        )
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH_JSON ")), None)
        if proc.returncode != 0 or line is None:
            print(proc.stdout[-3000:], proc.stderr[-6000:], sep="\n")
            print(f"[bench_offload] {m}: worker failed (exit {proc.returncode})")
            return 1
        results.append(json.loads(line.removeprefix("BENCH_JSON ")))
    print(report(results))
    print(f"\ntotal wall time {time.perf_counter() - t0:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
