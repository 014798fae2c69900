"""A pre-imported parent process that forks one child per mutant (what the mutation check runs its pytest in).

Why: every mutant's pytest run starts a new interpreter that imports torch, vLLM and vLLM-Omni before its first test
(seconds of CPU per interpreter, most of each mutant's time: docs/testing.md). Those packages are never mutated, so
they can be imported once.

How: ``python tools/mutation_zygote.py`` imports the third-party packages in :data:`PRELOAD` (never this project:
the zygote checks that no ``vllm_omni_ascend_opt`` or ``tests`` module is loaded), then reads one JSON request per
line on stdin: ``{"cwd", "env", "argv", "out"}``. For each it forks; the child becomes its own process group, takes
``env`` as its whole environment, puts ``cwd`` (the mutant's scratch tree) first on ``sys.path`` as ``PYTHONPATH``
would, sends stdout/stderr to ``out``, and exits with ``pytest.main(argv)``. The parent answers each request with one
line, ``{"rc": ...}``, when the child has exited (or ``null`` after killing its process group past the request's
timeout); :class:`Zygote` is the mutation check's side.
Children are independent of each other: the project, its tests and everything they import are imported fresh in each.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

#: Imported once in the zygote (third-party only: what every test process imports before the project's code).
PRELOAD = (
    "torch",
    "pytest",
    "numpy",
    "PIL.Image",
    "transformers",
    "diffusers",
    "vllm_omni",
    "vllm_omni.diffusion.models.qwen_image.qwen_image_transformer",
    "vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image",
)
#: Never loaded in the zygote: these are what the mutants change.
OWN = ("vllm_omni_ascend_opt", "tests", "benchmarks", "patches")
_HERE = str(Path(__file__).resolve().parent)


def _preload() -> None:
    import importlib

    names = os.environ.get("MUTATION_ZYGOTE_PRELOAD")  # a comma list instead of PRELOAD (the tool's own tests)
    for name in names.split(",") if names else PRELOAD:
        importlib.import_module(name)
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in OWN)
    if leaked:
        raise SystemExit(f"mutation zygote: the project was imported while preloading ({leaked[:3]})")


def _child(req: dict) -> None:
    """In the forked child: become the mutant's pytest process. Never returns."""
    code = 70
    try:
        os.setpgid(0, 0)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        fd = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.path[:] = [req["cwd"], *(p for p in sys.path if p not in ("", _HERE))]
        sys.argv = ["pytest", *req["argv"]]
        import pytest

        code = int(pytest.main(req["argv"]))
    except BaseException as exc:  # reported in the mutant's output, exit 70
        print(f"mutation zygote child: {type(exc).__name__}: {exc}", file=sys.stderr)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(pid: int, timeout: float) -> int | None:
    """``pid``'s exit code, or None after killing its process group when it runs past ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(pid, 0)
    return None


def serve() -> None:
    """The zygote's loop: one request per stdin line, one ``{"rc": code or null}`` line back when it is done."""
    proto = os.fdopen(os.dup(1), "w")  # the answers; whatever the imports print goes to stderr
    os.dup2(2, 1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _preload()
    # The preloaded heap is never garbage: frozen, no collection in a child scans it again (pytest collects five
    # times at the end of each session, most of a quick mutant's time otherwise), and its pages stay shared.
    gc.collect()
    gc.freeze()
    print(json.dumps({"ready": True}), file=proto, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(req)
        print(json.dumps({"rc": _wait(pid, float(req["timeout"]))}), file=proto, flush=True)


class Zygote:
    """The mutation check's handle on one zygote process (one mutant at a time)."""

    def __init__(self, python: str, env: dict[str, str]) -> None:
        env = {k: v for k, v in env.items() if k != "PYTHONPATH"}  # nothing of the checkout on the zygote's path
        self.proc = subprocess.Popen(
            [python, str(Path(__file__).resolve())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            text=True,
            start_new_session=True,
        )
        first = self.proc.stdout.readline()
        if not first or not json.loads(first).get("ready"):
            self.close()
            raise RuntimeError("mutation zygote did not start")

    def run(self, cwd: str, env: dict[str, str], argv: list[str], out: str, timeout: float) -> int | None:
        """Run pytest ``argv`` in a forked child; its exit code, or None when it ran past ``timeout`` (killed)."""
        req = {"cwd": cwd, "env": env, "argv": argv, "out": out, "timeout": timeout}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError("mutation zygote exited")
        return json.loads(answer)["rc"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


if __name__ == "__main__":
    serve()
