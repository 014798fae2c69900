"""Run vLLM-Omni's offline engine ``Omni`` on a model directory (a child process of tests/test_omni_offline.py).

usage: python omni_offline_script.py MODEL_DIR OUT_DIR '{"distributed_executor_backend": "mp"}'
Generates the requests below, saves each image as OUT_DIR/<i>.npy and writes OUT_DIR/result.json (its pid).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REQUESTS = [
    {"height": 32, "width": 32, "steps": 2, "seed": 42, "cfg": 1.0},
    {"height": 48, "width": 32, "steps": 3, "seed": 7, "cfg": 4.0},
]


def main() -> None:
    model, out, kwargs = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    import numpy as np
    import torch
    from vllm_omni.diffusion.utils.image_output import extract_images_from_outputs
    from vllm_omni.entrypoints.omni import Omni
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    omni = Omni(model=model, dtype="float32", enforce_eager=True, **kwargs)
    try:
        for i, r in enumerate(REQUESTS):
            sp = OmniDiffusionSamplingParams(
                height=r["height"],
                width=r["width"],
                num_inference_steps=r["steps"],
                seed=r["seed"],
                generator=torch.Generator("cpu").manual_seed(r["seed"]),
                true_cfg_scale=r["cfg"],
                max_sequence_length=64,
            )
            prompt = "a red cat" if r["cfg"] <= 1.0 else {"prompt": "a red cat", "negative_prompt": "blurry"}
            outs = omni.generate(prompt, sampling_params_list=[sp], use_tqdm=False)
            image = extract_images_from_outputs(outs)[0]
            np.save(out / f"{i}.npy", np.asarray(image.convert("RGB"), dtype=np.uint8))
    finally:
        omni.close()
    (out / "result.json").write_text(json.dumps({"pid": os.getpid()}))


if __name__ == "__main__":  # the mp executor spawns its worker: the module must be import-safe
    main()
