"""One ablation configuration in its own process: ``python -m vllm_omni_ascend_opt.ablation.worker --job JOB.json``.

The plugin is loaded as vLLM-Omni loads it, the job's engine (:mod:`.engines`) loads the model once, the worker checks
that exactly the configuration's optimizations act, then answers ``run`` commands until ``exit``.

The line protocol with the runner (parent): one JSON object per line, commands on the worker's stdin, events on its
stdout (anything else the worker prints goes to stderr, the configuration's log). worker -> parent::

    {"event": "ready", "protocol": 1, "pid": 123, "load_s": 4.2, "env": {...}, "active": [...] | null, "memory": ...}
    {"event": "result", "id": 7, "total_ms": 61.2, "stages_ms": {...}, "cpu_ms": 60.8 | null, "sha256": "...",
     "saved": true}
    {"event": "error", "id": 7 | null, "phase": "start" | "run", "error": "...", "traceback": "..."}
    {"event": "bye"}

parent -> worker: ``{"cmd": "run", "id": 7, "prompt": 0, "seed": 42, "save": "/out/images/full/p0_s42" | null}``,
``{"cmd": "exit"}``. After an ``error`` the parent records the configuration as failed.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import json
import os
import platform
import sys
import time
import traceback
from importlib import metadata
from pathlib import Path
from typing import IO, Any

from vllm_omni_ascend_opt.ablation.engines import ENGINES, Generation

PROTOCOL_VERSION = 1


def send(stream: IO[str], obj: dict[str, Any]) -> None:
    """One protocol message: a compact JSON line, flushed at once (the other side blocks on it)."""
    stream.write(json.dumps(obj, separators=(",", ":")) + "\n")
    stream.flush()


def decode(line: str) -> dict[str, Any]:
    """One protocol line as its message; anything but a JSON object is an error, not a message."""
    obj = json.loads(line)
    if not isinstance(obj, dict):
        raise ValueError(f"protocol message is not an object: {line[:200]!r}")
    return obj


def _version(dist: str) -> str | None:
    with contextlib.suppress(metadata.PackageNotFoundError):
        return metadata.version(dist)
    return None


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def environment(device: str) -> dict[str, Any]:
    """Versions and the device, as this worker sees them (stored in results.json)."""
    import torch

    from vllm_omni_ascend_opt import _backend

    kind = device.split(":")[0]
    name = _cpu_name()
    with contextlib.suppress(Exception):
        if kind == "npu":
            name = torch.npu.get_device_name(0)
        elif kind == "cuda":
            name = torch.cuda.get_device_name(0)
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_npu": _version("torch_npu") or _version("torch-npu"),
        "cann": _backend.cann_version() if kind == "npu" else None,
        "cuda": torch.version.cuda if kind == "cuda" else None,
        "vllm": _version("vllm"),
        "vllm_omni": _version("vllm-omni") or _version("vllm_omni"),
        "diffusers": _version("diffusers"),
        "transformers": _version("transformers"),
        "vllm_omni_ascend_opt": _version("vllm-omni-ascend-opt"),
        "device": {"type": kind, "name": name, "cpu": _cpu_name(), "torch_threads": torch.get_num_threads()},
        "flag": os.environ.get("VLLM_OMNI_ASCEND_OPT"),
    }


def save_generation(gen: Generation, stem: str) -> None:
    """``stem.png`` (uint8) and, when there is a float output, ``stem.npy``; written atomically."""
    import numpy as np
    from PIL import Image

    path = Path(stem)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}.png")
    Image.fromarray(gen.uint8).save(tmp)
    os.replace(tmp, path.with_suffix(".png"))
    if gen.float_chw is not None:
        tmp = path.with_name(path.name + f".tmp{os.getpid()}.npy")
        np.save(tmp, gen.float_chw.astype(np.float32))
        os.replace(tmp, path.with_suffix(".npy"))


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:4000]


def _error_event(cid: int | None, phase: str, error: str, tb: str = "") -> dict[str, Any]:
    return {"event": "error", "id": cid, "phase": phase, "error": error, "traceback": tb}


def load_plugin_like_vllm_omni() -> None:
    """Load general plugins exactly as every vLLM-Omni process does, and check ours was among them."""
    from vllm_omni.plugins import load_omni_general_plugins

    from vllm_omni_ascend_opt._state import STATE

    load_omni_general_plugins()
    if not STATE.registered:
        raise RuntimeError(
            "vLLM-Omni did not load the vllm-omni-ascend-opt plugin (is the package installed, and does VLLM_PLUGINS, "
            "if set, name 'ascend_opt'?)"
        )
    if STATE.config_error:
        raise RuntimeError(f"the plugin rejected its flags: {STATE.config_error}")


def serve(job: dict[str, Any], proto_out: Any, commands: Any) -> int:
    """Start up, report ready, answer commands. Returns the process exit code."""
    try:
        if job.get("protocol") != PROTOCOL_VERSION:
            raise RuntimeError(f"protocol mismatch: parent {job.get('protocol')}, worker {PROTOCOL_VERSION}")
        if job.get("threads"):
            import torch

            torch.set_num_threads(int(job["threads"]))
        from vllm_omni_ascend_opt import registry

        registry.all_optimizations()  # built-ins first: extra modules add to the registry, never replace it
        for mod in job.get("imports") or []:
            importlib.import_module(mod)
        if job["engine"] != "serve":  # a server loads the plugin in its own processes
            load_plugin_like_vllm_omni()
        engine = ENGINES[job["engine"]](job)
        t0 = time.perf_counter()
        engine.load()
        load_s = time.perf_counter() - t0
        active = engine.active()
        wanted = list(job["config"]["opts"])
        if active is not None and sorted(active) != sorted(wanted):
            missing = {n: engine.model_reasons(n) for n in wanted if n not in active}
            extra = [n for n in active if n not in wanted]
            parts = [f"{n} is off ({'; '.join(r) or 'no reason given'})" for n, r in missing.items()]
            parts += [f"{n} is active but was not requested" for n in extra]
            raise RuntimeError("the worker's optimizations differ from the configuration: " + "; ".join(parts))
        ready = {"pid": os.getpid(), "load_s": load_s, "env": environment(engine.device), "active": active}
        try:  # the engine's memory probe; none when the model is in another process, a failed probe reported
            ready["memory"] = engine.memory() if hasattr(engine, "memory") else None
        except Exception as exc:
            ready["memory"] = {"error": _error(exc)}
        send(proto_out, {"event": "ready", "protocol": PROTOCOL_VERSION, **ready})
    except BaseException as exc:  # report anything, then exit non-zero
        send(proto_out, _error_event(None, "start", _error(exc), traceback.format_exc()))
        return 3
    prompts = job["prompts"]
    for line in commands:
        if not line.strip():
            continue
        cmd = decode(line)
        if cmd.get("cmd") == "exit":
            break
        if cmd.get("cmd") != "run":
            send(proto_out, _error_event(cmd.get("id"), "run", f"unknown command {cmd!r}"))
            continue
        try:
            gen = engine.generate(prompts[int(cmd["prompt"])], int(cmd["seed"]))
            if cmd.get("save"):
                save_generation(gen, cmd["save"])
            sha = hashlib.sha256(gen.uint8.tobytes()).hexdigest()[:16]
            result = {"total_ms": gen.total_ms, "stages_ms": gen.stages_ms, "cpu_ms": gen.cpu_ms, "sha256": sha}
            send(proto_out, {"event": "result", "id": cmd["id"], **result, "saved": bool(cmd.get("save"))})
        except BaseException as exc:  # an OOM or a kernel error fails this configuration only
            send(proto_out, _error_event(cmd.get("id"), "run", _error(exc), traceback.format_exc()))
            if isinstance(exc, KeyboardInterrupt):
                break
    engine.close()
    send(proto_out, {"event": "bye"})
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="one ablation configuration (started by the ablation runner)")
    ap.add_argument("--job", required=True, help="job description written by the runner (JSON)")
    args = ap.parse_args(argv)
    job = json.loads(Path(args.job).read_text())
    # Keep the protocol channel clean: our events go to the original stdout; anything else printed to stdout
    # (vLLM's logger, tqdm, print) goes to stderr, which the runner keeps as this configuration's log.
    proto_out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return serve(job, proto_out, sys.stdin)


if __name__ == "__main__":
    sys.exit(main())
