"""The plugin's state in this process, in one object: what is selected, and why nothing may be patched.

Written by ``_plugin`` (``register()``, ``set_selected``); read downward by the report, the API and the CLI. Each
optimization answers for itself whether it acts (``Optimization.reasons_inactive``); this object adds the facts
that belong to the plugin: the selection, a bad flag, an unsupported vLLM-Omni / vLLM.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from vllm_omni_ascend_opt import flags


@dataclass
class PluginState:
    #: ``register()`` ran in this process.
    registered: bool = False
    #: Selected names in registry order (by the flags or the Python API).
    selected: list[str] = field(default_factory=list)
    #: The flag's error message when ``VLLM_OMNI_ASCEND_OPT`` is invalid (then nothing is patched).
    config_error: str | None = None
    #: Why the installed vLLM-Omni / vLLM are not supported (nothing is patched unless forced).
    version_error: str | None = None

    def blocked(self) -> bool:
        """Nothing may be installed: a bad flag, or an unsupported version without ``VLLM_OMNI_ASCEND_OPT_FORCE``."""
        return self.config_error is not None or (self.version_error is not None and not flags.force_from_env())

    def reasons(self, name: str) -> list[str]:
        """The plugin's own reasons why ``name`` cannot act here (the optimization adds its own)."""
        if self.config_error is not None:
            return [f"{flags.ENV_FLAG} is invalid, so nothing is patched"]
        out = [] if name in self.selected else [f"not selected by {flags.ENV_FLAG}"]
        if self.version_error is not None and not flags.force_from_env():
            out.append(self.version_error)
        return out

    def reset(self) -> None:
        self.registered = False
        self.selected = []
        self.config_error = None
        self.version_error = None


STATE = PluginState()
#: Guards every change of the selection and of what is installed.
LOCK = threading.RLock()
