"""One cache for kernel verdicts, with one invalidation rule.

Every kernel path the plugin takes on an NPU is verified before use (per device and dtype, and again per *shape
class* on the first real call): ``rope``'s ``npu_rotary_mul``, ``qk_norm``'s ``npu_rms_norm``, ``fused_attention``'s
``npu_fusion_attention``, ``nz_weights``' FRACTAL_NZ linears, ``vae_exact``'s native-dtype upsample.

The rule: a verdict belongs to the backend probe (:func:`vllm_omni_ascend_opt._backend.probe_id`) it was made under;
when the probe changes (another ``torch_npu`` module, or a re-probe after ``_backend.reset_cache``), every entry is
dropped before the next read or write. ``clear()`` drops them too (an optimization's ``uninstall``). Nothing else
removes a verdict: a shape class keeps its verdict for the life of the process.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from vllm_omni_ascend_opt import _backend

V = TypeVar("V")


class VerdictCache(Generic[V]):
    """Verdicts by key, valid for the backend probe they were made under (see the module docstring)."""

    def __init__(self) -> None:
        self._entries: dict[Hashable, V] = {}
        self._probe: int | None = None

    def _live(self) -> dict[Hashable, V]:
        probe = _backend.probe_id()
        if probe != self._probe:
            self._entries.clear()
            self._probe = probe
        return self._entries

    def get(self, key: Hashable) -> V | None:
        return self._live().get(key)

    def put(self, key: Hashable, verdict: V) -> V:
        self._live()[key] = verdict
        return verdict

    def get_or_make(self, key: Hashable, make: Callable[[], V]) -> tuple[V, bool]:
        """``(verdict, made)``: the cached verdict for ``key``, or ``make()``'s, stored (``made`` True)."""
        entries = self._live()
        if key in entries:
            return entries[key], False
        verdict = entries[key] = make()
        return verdict, True

    def drop(self, key: Hashable) -> None:
        """Forget ``key`` (a fault that cleared; never a verdict: see the module docstring)."""
        self._live().pop(key, None)

    def values(self) -> list[V]:
        return list(self._live().values())

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._live())
