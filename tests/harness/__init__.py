"""Test-only harnesses: the gloo parallel-mode workers, vLLM-Omni's runner, the tiny Qwen-Image-2.1 model and LoRA
adapters for the tests, built on the test bed (``vllm_omni_ascend_opt.testbed``) but not shipped with the plugin."""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path
from types import ModuleType

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
