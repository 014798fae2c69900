"""A stand-in for ``vllm_omni_ascend_opt.ablation.worker`` that speaks the same protocol without vLLM-Omni.

The runner's tests start it instead of the real worker to exercise scheduling, crash handling, timeouts and resume
in well under a second per process. Its behaviour comes from the ``ABLATION_FAKE`` environment variable (JSON):

    base_ms            time of stock (default 100)
    saves_ms           {opt: ms}: time saved when the configuration includes opt
    save_stage         {opt: stage}: the stage whose time opt saves (default: the time is split 10% text_encode,
                       60% denoise, 30% vae_decode, savings included)
    stage_delay_ms     {config id: {stage: ms}}: added to that stage (and the total) in that configuration's
                       processes (a process that simply runs slower in a stage nothing compared there changes)
    ctrl_offset_ms     added to the control configuration (sets the noise floor)
    perturb            {opt: amplitude}: image changes when the configuration includes opt
    quantized_ms       denoise time saved when the job's od_config sets quantization_config (vLLM-Omni's int8)
    quantized_perturb  image change (amplitude) when the job's od_config sets quantization_config
    crash_start        [config ids]: exit with code 3 before "ready"
    error_run          {config id: n}: the n-th run (1-based, warm-ups included) answers an error event
    die_run            {config id: n}: the n-th run kills this process with SIGKILL (as the OOM killer would)
    hang_run           {config id: n}: the n-th run never answers
    sigint_parent      {config id: n}: the n-th run sends SIGINT to the runner (an interrupted run), then answers
    (a job with dtype bfloat16 gets its float image rounded to bfloat16: close to float32's, not pixel-identical)
    starts_log         a file that gets one line "config pid [child pid]" per process start
    engine_child       start a child process in this worker's process group (as an engine's worker would be)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time

import numpy as np


def _image(seed: int, prompt: int, amp: float, h: int, w: int) -> np.ndarray:
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([np.sin(xx / (3 + seed % 5) + prompt), np.cos(yy / 4 + seed / 7), np.sin((xx + yy) / 6)], 0)
    img = 0.8 * base
    if amp:
        rng = np.random.default_rng(seed * 1000 + prompt)
        img = img + amp * rng.standard_normal(img.shape).astype(np.float32)
    return np.clip(img, -1, 1).astype(np.float32)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", required=True)
    args = ap.parse_args()
    job = json.loads(open(args.job).read())
    fake = json.loads(os.environ.get("ABLATION_FAKE", "{}"))
    cid = job["config"]["id"]
    opts = job["config"]["opts"]
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    spec = os.environ.get("VLLM_OMNI_ASCEND_OPT")
    print(f"fake worker {cid} pid {os.getpid()} flag {spec}", file=sys.stderr)
    child = None
    if fake.get("engine_child"):
        import subprocess

        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    if fake.get("starts_log"):
        with open(fake["starts_log"], "a") as f:
            f.write(f"{cid} {os.getpid()}" + (f" {child.pid}" if child else "") + "\n")
    if cid in fake.get("crash_start", []):
        print("Traceback: simulated import crash", file=sys.stderr)
        return 3

    def send(obj):
        out.write(json.dumps(obj) + "\n")
        out.flush()

    send(
        {
            "event": "ready",
            "protocol": 1,
            "pid": os.getpid(),
            "load_s": 0.01,
            "active": opts,
            "env": {
                "python": "3",
                "torch": "fake",
                "torch_npu": None,
                "vllm": "0.30.0",
                "vllm_omni": "0.30.0",
                "device": {"type": "cpu", "name": "fake"},
                "flag": spec,
            },
        }
    )
    n = 0
    base = float(fake.get("base_ms", 100.0))
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "exit":
            break
        n += 1
        if fake.get("die_run", {}).get(cid) == n:
            os.kill(os.getpid(), signal.SIGKILL)
        if fake.get("hang_run", {}).get(cid) == n:
            time.sleep(3600)
        if fake.get("error_run", {}).get(cid) == n:
            send(
                {
                    "event": "error",
                    "id": cmd["id"],
                    "phase": "run",
                    "error": "OutOfMemoryError: simulated",
                    "traceback": "Traceback ...\nOutOfMemoryError: simulated",
                }
            )
            continue
        if fake.get("sigint_parent", {}).get(cid) == n:
            os.kill(os.getppid(), signal.SIGINT)
        total = base - sum(v for k, v in fake.get("saves_ms", {}).items() if k in opts)
        if job["config"]["id"] == "full_ctrl":
            total += float(fake.get("ctrl_offset_ms", 0.0))
        share = {"text_encode": 0.1, "denoise": 0.6, "vae_decode": 0.3}
        own = fake.get("save_stage", {})
        staged = {k: v for k, v in fake.get("saves_ms", {}).items() if k in opts and k in own}
        total += sum(staged.values())  # split the rest, then take these from their own stage
        stages = {st: f * total for st, f in share.items()}
        for k, v in staged.items():
            stages[own[k]] -= v
            total -= v
        quantized = bool((job.get("od_config") or {}).get("quantization_config"))
        if quantized:
            stages["denoise"] -= float(fake.get("quantized_ms", 0.0))
            total -= float(fake.get("quantized_ms", 0.0))
        for st, ms in fake.get("stage_delay_ms", {}).get(cid, {}).items():
            stages[st] += float(ms)
            total += float(ms)
        amp = sum(v for k, v in fake.get("perturb", {}).items() if k in opts)
        amp += float(fake.get("quantized_perturb", 0.0)) if quantized else 0.0
        img = _image(int(cmd["seed"]), int(cmd["prompt"]), amp, job["height"], job["width"])
        if job.get("dtype") == "bfloat16":  # keep the top 16 bits of each float32, as a bf16 cast does
            img = (img.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
        u8 = np.round(np.clip((img.astype(np.float64) + 1) / 2, 0, 1).transpose(1, 2, 0) * 255).astype(np.uint8)
        if cmd.get("save"):
            from PIL import Image

            os.makedirs(os.path.dirname(cmd["save"]), exist_ok=True)
            np.save(cmd["save"] + ".npy", img)
            Image.fromarray(u8).save(cmd["save"] + ".png")
        send(
            {
                "event": "result",
                "id": cmd["id"],
                "total_ms": total,
                "cpu_ms": total,
                "stages_ms": stages,
                "sha256": hashlib.sha256(u8.tobytes()).hexdigest()[:16],
                "saved": bool(cmd.get("save")),
            }
        )
    if child is not None:
        child.kill()
        child.wait()
    send({"event": "bye"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
