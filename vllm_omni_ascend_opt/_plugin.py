"""``register()``: the vLLM-Omni general-plugin entry point, and the machinery that installs patches in time.

vLLM-Omni calls ``register`` once per process before the model is built; it must be cheap and idempotent and must not
import the Qwen-Image modules. A post-import hook installs an optimization when the last of its ``target_modules``
finishes importing. The upstream code's fingerprints decide what installs; the version only sets a floor.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
from collections.abc import Iterable
from importlib import metadata

from vllm_omni_ascend_opt import _report, flags, registry
from vllm_omni_ascend_opt._patching import PatchSet
from vllm_omni_ascend_opt._state import LOCK, STATE
from vllm_omni_ascend_opt.blocks.upstream import fingerprints, targets

logger = logging.getLogger("vllm_omni_ascend_opt")

LOADER_MODULE = targets.LOADER

_core = PatchSet("core")


class PluginConfigError(RuntimeError):
    """Raised in strict mode when the flags are bad or a selected optimization cannot be active."""


# ----- post-import hook
class _NotifyingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        # The module is complete; mark it so before patching (importlib sets this after exec returns).
        if (spec := getattr(module, "__spec__", None)) is not None:
            spec._initializing = False
        _on_import(module.__name__)

    def __getattr__(self, item):  # get_source, is_package, ... for tools that ask the loader
        return getattr(self._inner, item)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Wraps the loader of watched modules so that ``_on_import(name)`` runs right after the module executes."""

    def __init__(self) -> None:
        self.watched: set[str] = set()
        self._busy: set[str] = set()

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.watched or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            finders = (f for f in sys.meta_path if f is not self and hasattr(f, "find_spec"))
            spec = next((s for f in finders if (s := f.find_spec(fullname, path, target)) is not None), None)
        finally:
            self._busy.discard(fullname)
        if spec is not None and spec.loader is not None and not isinstance(spec.loader, _NotifyingLoader):
            spec.loader = _NotifyingLoader(spec.loader)
        return spec


_finder = _PostImportFinder()


def _watch(modules: Iterable[str]) -> None:
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    _finder.watched.update(modules)


def _on_import(name: str) -> None:
    try:
        install_ready()
    except Exception:
        logger.exception("vllm-omni-ascend-opt: installing patches after importing %s failed", name)


# ----- installing what is selected
def selected() -> list[str]:
    """Names currently selected (by the flags or the Python API), in registry order."""
    return list(STATE.selected)


def set_selected(names: Iterable[str]) -> None:
    """Make exactly ``names`` selected: uninstall the others, install these (now or when their modules import)."""
    wanted = set(names)
    with LOCK:
        for opt in registry.all_optimizations():
            if opt.name not in wanted and opt.installed:
                opt.uninstall()
        STATE.selected = [n for n in registry.names() if n in wanted]
        _watch({m for n in STATE.selected for m in registry.get(n).target_modules} | {LOADER_MODULE})
        install_ready()


def install_ready() -> list[str]:
    """Install every selected optimization that can be active and whose target modules are imported."""
    done = []
    with LOCK:
        _install_core()
        if STATE.blocked():
            return done
        for name in STATE.selected:
            opt = registry.get(name)
            if opt.installed or not all(fingerprints.fully_imported(m) for m in opt.target_modules):
                continue
            if reasons := opt.reasons_inactive():
                logger.debug("vllm-omni-ascend-opt: %s stays off: %s", name, "; ".join(reasons))
                continue
            if fingerprints.forced() and (differs := fingerprints.reasons(opt.upstream, opt.name)):
                logger.warning(
                    "vllm-omni-ascend-opt: installing %s although %s (%s=1; its exactness is not established here).",
                    name,
                    "; ".join(differs),
                    fingerprints.ENV_FORCE,
                )
            opt.install()
            done.append(name)
    if done:
        logger.debug("vllm-omni-ascend-opt: installed %s", ", ".join(done))
    if STATE.registered:
        _report.announce()  # the one INFO line, once nothing selected waits for a module any more
    return done


def _install_core() -> None:
    """Attach installed optimizations to every pipeline vLLM-Omni's loader builds, and report on it."""
    if not fingerprints.fully_imported(LOADER_MODULE):
        return
    loader_cls = sys.modules[LOADER_MODULE].DiffusersPipelineLoader
    if _core.is_patched(loader_cls, "load_model"):
        return
    original = loader_cls.load_model

    def load_model(self, *args, **kwargs):
        model = original(self, *args, **kwargs)
        attach_all(model)
        _report.announce(force=True)  # no-op when already logged
        _report.track_model(model)  # status file, when VLLM_OMNI_ASCEND_OPT_STATUS_FILE asks for one
        return model

    load_model.__wrapped__ = original  # type: ignore[attr-defined]
    _core.set(loader_cls, "load_model", load_model)


def attach_all(model) -> list[str]:
    """Attach every installed optimization to ``model`` (a pipeline or a transformer); returns what acts on it."""
    for opt in registry.all_optimizations():
        if not opt.installed:
            continue
        try:
            opt.attach(model)
        except Exception:
            if flags.strict_from_env():
                raise
            logger.exception("vllm-omni-ascend-opt: attaching %s failed; it stays off for this model", opt.name)
    return _report.acting(model)


# ----- entry point
def installed_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def register() -> None:
    """Read the flags, check the vLLM-Omni floor, install patches in time. Idempotent. Bad flags patch nothing and
    log an error; ``VLLM_OMNI_ASCEND_OPT_STRICT=1`` raises :class:`PluginConfigError` instead, also for a selected
    optimization that cannot be active here. The loader hook is installed in every case (status file)."""
    with LOCK:
        if STATE.registered:
            return
        STATE.registered = True
        _report.wire_into_vllm_logging()
        strict = flags.strict_from_env()
        try:
            names = flags.parse_spec(flags.spec_from_env())
        except flags.FlagError as exc:
            STATE.config_error = str(exc)
            logger.error("vllm-omni-ascend-opt: %s Nothing is patched.", exc)
            _refuse(str(exc), strict)
            return
        STATE.check_version(installed_version("vllm-omni"))
        if STATE.version_note:
            logger.info("vllm-omni-ascend-opt: %s.", STATE.version_note)
        if STATE.version_error and flags.force_from_env():
            logger.warning("vllm-omni-ascend-opt: %s; patching anyway (%s=1).", STATE.version_error, flags.ENV_FORCE)
        elif STATE.version_error:
            logger.warning(
                "vllm-omni-ascend-opt: %s. Nothing is patched; set %s=1 to try anyway.",
                STATE.version_error,
                flags.ENV_FORCE,
            )
            _refuse(STATE.version_error, strict)
            return
        if strict and (bad := {n: r for n in names if (r := registry.get(n).reasons_inactive())}):
            msg = "; ".join(f"{n}: {', '.join(r)}" for n, r in bad.items())
            raise PluginConfigError(f"selected optimizations cannot be active here ({msg})")
        set_selected(names)
        logger.debug("vllm-omni-ascend-opt: selected %s", ", ".join(names) or "nothing")
        _report.announce()


def _refuse(why: str, strict: bool) -> None:
    """A bad flag or version: raise when strict; else select nothing but write the status file now and on load."""
    if strict:
        raise PluginConfigError(why) from None
    _watch({LOADER_MODULE})
    _install_core()
    _report.write_status_file_safely()


def _reset_for_tests() -> None:
    """Return to the never-registered state (uninstalls everything)."""
    with LOCK:
        for opt in registry.all_optimizations():
            opt.uninstall()
        _core.revert()
        STATE.reset()
        _report._seen.clear()
