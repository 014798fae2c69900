"""Test-only harnesses: the gloo parallel-mode workers, vLLM-Omni's runner, the tiny Qwen-Image-2.1 model and LoRA
adapters for the tests, built on the test bed (``vllm_omni_ascend_opt.testbed``) but not shipped with the plugin."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def load_script(name: str, rel: str) -> ModuleType:
    """The repository script ``rel`` (not in a package) imported from its file as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, REPO / rel)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


class LogLines(logging.Handler):
    """Keeps the messages it handles that contain ``mark`` (in any case)."""

    def __init__(self, mark: str = "", level: int = logging.DEBUG) -> None:
        super().__init__(level)
        self.mark = mark.lower()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if self.mark in (msg := record.getMessage()).lower():
            self.lines.append(msg)


def run_python(code: str, env: dict[str, str] | None = None, timeout: float = 900, **extra: str):
    """Dedented ``code`` in a fresh interpreter: ``env`` (default: ours) plus ``extra``, this repository first."""
    e = {**(os.environ if env is None else env), **extra}
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), e.get("PYTHONPATH")]))
    cmd = [sys.executable, "-c", textwrap.dedent(code)]
    return subprocess.run(cmd, capture_output=True, text=True, env=e, timeout=timeout)


def last_json(proc: subprocess.CompletedProcess) -> Any:
    """The last stdout line of a child that must have succeeded, as JSON."""
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
