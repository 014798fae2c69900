"""The test bed's CPU runtime in every process vLLM-Omni's engines start (on ``PYTHONPATH`` through ``engine_env``;
acts only with ``VLLM_OMNI_ASCEND_OPT_CPU_RUNTIME=1``; standard library only):

1. without torchvision, ``transformers.models.<m>.image_processing_<x>`` is served from ``image_processing_pil_<x>``;
2. without torchaudio (the OpenAI server imports it), an import-only placeholder is served;
3. ``load_omni_general_plugins`` first applies ``apply_engine_cpu_runtime`` (plugin installed, excluded or broken).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

ENV = "VLLM_OMNI_ASCEND_OPT_CPU_RUNTIME"
_TRANSFORMERS_MODELS = "transformers.models."


class _TorchvisionFreeImageProcessors(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith(_TRANSFORMERS_MODELS):
            return None
        head, _, leaf = fullname.rpartition(".")
        if not leaf.startswith("image_processing_") or leaf.startswith("image_processing_pil_"):
            return None
        twin = f"{head}.image_processing_pil_{leaf[len('image_processing_') :]}"
        if importlib.util.find_spec(twin) is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, loader_state=twin)

    def exec_module(self, module) -> None:
        twin = module.__spec__.loader_state
        for name, value in vars(importlib.import_module(twin)).items():
            if name.startswith("__"):
                continue
            setattr(module, name, value)
            if isinstance(value, type) and name.endswith("ImageProcessorPil"):
                setattr(module, name[: -len("Pil")], value)
        module.__ascend_opt_cpu_twin__ = twin


class _AudioPlaceholders(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.partition(".")[0] == "torchaudio":
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def exec_module(self, module) -> None:
        owner = module.__name__

        def __getattr__(name: str):
            if name.startswith("__"):
                raise AttributeError(name)

            def unavailable(*args, **kwargs):
                raise RuntimeError(f"{owner}.{name} is a placeholder of the test bed's CPU runtime (no audio on CPU)")

            return unavailable

        module.__getattr__ = __getattr__
        module.__version__ = "0+ascend-opt-cpu-placeholder"


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``action(module)`` right after the module ``name`` has executed (once)."""

    def __init__(self, name: str, action) -> None:
        self.name = name
        self.action = action
        self._busy = False

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name or self._busy:
            return None
        self._busy = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy = False
        if spec is None or spec.loader is None:
            return spec
        exec_module, action = spec.loader.exec_module, self.action

        def then(module) -> None:
            exec_module(module)
            action(module)

        spec.loader.exec_module = then  # this spec's own loader instance
        return spec


def _apply_runtime_before_plugins(plugins) -> None:
    """Wrap ``vllm_omni.plugins.load_omni_general_plugins``: the CPU runtime first, then the plugins."""
    original = plugins.load_omni_general_plugins

    def load_omni_general_plugins():
        from vllm_omni_ascend_opt.testbed.runtime import apply_engine_cpu_runtime

        apply_engine_cpu_runtime()
        return original()

    load_omni_general_plugins.__wrapped__ = original
    plugins.load_omni_general_plugins = load_omni_general_plugins


def install_import_fallbacks(audio: bool = True) -> None:
    """Item 1 and, with ``audio``, item 2: serve the missing torchvision / torchaudio imports (idempotent)."""
    if importlib.util.find_spec("torchvision") is None and not any(
        isinstance(f, _TorchvisionFreeImageProcessors) for f in sys.meta_path
    ):
        sys.meta_path.insert(0, _TorchvisionFreeImageProcessors())
    if audio and importlib.util.find_spec("torchaudio") is None:
        sys.meta_path.append(_AudioPlaceholders())  # last: only for names no other finder knows


def _chain_next_sitecustomize() -> None:
    """Run the ``sitecustomize`` this one shadows (a later entry of ``sys.path``), if there is one."""
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == here:
            continue
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_ascend_opt_shadowed_sitecustomize", candidate)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


if __name__ == "sitecustomize":  # at interpreter start (not when the test bed loads this file in-process)
    if os.environ.get(ENV) == "1":
        try:
            sys.meta_path.insert(0, _AfterImport("vllm_omni.plugins", _apply_runtime_before_plugins))
            install_import_fallbacks()
        except Exception as exc:  # never break interpreter start-up
            print(f"vllm-omni-ascend-opt CPU runtime: import workarounds not installed: {exc!r}", file=sys.stderr)
    _chain_next_sitecustomize()
