"""The plugin's state in this process: what is selected, the installed vLLM-Omni, and why nothing may be patched (a
bad flag, a missing or too old vLLM-Omni). Written by ``_plugin``; read by the report, the API and the CLI.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field

from vllm_omni_ascend_opt import flags
from vllm_omni_ascend_opt.blocks.upstream import fingerprints


def release_tuple(version: str) -> tuple[int, ...]:
    """``(major, minor)`` of a version string (``0.32.0rc1`` -> ``(0, 32)``); ``()`` when it has none."""
    m = re.match(r"(\d+)\.(\d+)", version.strip())
    return (int(m.group(1)), int(m.group(2))) if m else ()


@dataclass
class PluginState:
    registered: bool = False
    #: Selected names in registry order (by the flags or the Python API).
    selected: list[str] = field(default_factory=list)
    #: The flag's error message when ``VLLM_OMNI_ASCEND_OPT`` is invalid (then nothing is patched).
    config_error: str | None = None
    #: The installed vLLM-Omni version, as ``register()`` read it (None: not read, or not installed).
    omni_version: str | None = None
    #: Why the installed vLLM-Omni cannot be patched at all: not installed, or older than ``fingerprints.MIN_OMNI``.
    version_error: str | None = None
    #: A release the plugin was not checked on (not in ``fingerprints.KNOWN_OMNI``), logged once at INFO.
    version_note: str | None = None

    def check_version(self, version: str | None) -> None:
        """Record the installed vLLM-Omni ``version`` and what it means. The version decides only the floor."""
        self.omni_version, self.version_error, self.version_note = version, None, None
        floor = ".".join(map(str, fingerprints.MIN_OMNI))
        if version is None:
            self.version_error = f"vllm-omni is not installed (the plugin patches vLLM-Omni >= {floor})"
            return
        rel = release_tuple(version)
        if not rel or rel < fingerprints.MIN_OMNI:
            self.version_error = (
                f"vllm-omni {version} is not a supported version (supported: vLLM-Omni >= {floor} whose code "
                "matches the plugin's known source fingerprints)"
            )
        elif version not in fingerprints.KNOWN_OMNI:
            self.version_note = (
                f"vllm-omni {version} is not one of the releases the plugin was checked on "
                f"({', '.join(fingerprints.KNOWN_OMNI)}): each optimization installs only where the upstream code it "
                "patches or mirrors matches a known source fingerprint (vllm-omni-ascend-opt list shows which)"
            )

    def blocked(self) -> bool:
        """Nothing may be installed: a bad flag, or no / a too old vLLM-Omni without ``VLLM_OMNI_ASCEND_OPT_FORCE``."""
        return self.config_error is not None or (self.version_error is not None and not flags.force_from_env())

    def reasons(self, name: str) -> list[str]:
        """The plugin's own reasons why ``name`` cannot act here (the optimization adds its own)."""
        if self.config_error is not None:
            return [f"{flags.ENV_FLAG} is invalid, so nothing is patched"]
        cause = [self.version_error] if self.blocked() else []  # the selection was dropped because of it
        return cause if name in self.selected else [*cause, f"not selected by {flags.ENV_FLAG}"]

    def reset(self) -> None:
        vars(self).update(vars(PluginState()))


STATE = PluginState()
#: Guards every change of the selection and of what is installed.
LOCK = threading.RLock()
