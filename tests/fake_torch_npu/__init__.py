"""A semantic fake of ``torch_npu`` for CPU tests (tests/ only, never shipped): each kernel computes its *documented*
result with plain torch and raises on *documented* constraint violations, so the plugin's NPU paths run for real.

Each kernel module lists its constraints with their sources (:mod:`.rotary`, :mod:`.attention`, :mod:`.formats`,
:mod:`.norms`, :mod:`.quant`); tests/test_fake_torch_npu_reference.py checks the ops against the pinned torch-npu
2.13.0 wheel (:mod:`.reference`). Abbreviated sources: [OP-ROT] Ascend/op-plugin docs ``torch_npu-npu_rotary_mul.md``,
[OP-FA] ``torch_npu-npu_fusion_attention.md``, [OP-FIA] ``torch_npu-npu_fused_infer_attention_score.md``, [OP-FMT]
``torch_npu-npu_format_cast.md``; [DESIGN] ``../shared/design/torch-npu-kernels.md`` (a digest of those pages).

``install(monkeypatch, **variants)`` puts the fake in ``sys.modules['torch_npu']`` and ``torch.npu``; ``variants``
swap in deliberately wrong kernels (e.g. ``rotary_mul="half_pairing"``) the plugin's verification must refuse.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import types
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch

from tests.fake_torch_npu import attention, formats, norms, quant, rotary
from tests.fake_torch_npu.timing import TimingPlan
from vllm_omni_ascend_opt.testbed.npu_ops import run_npu_kernel

#: Kernel name -> {variant name -> implementation}. "correct" is the documented behaviour.
KERNELS: dict[str, dict[str, Any]] = {
    k: dict(v) for m in (rotary, attention, formats, norms, quant) for k, v in m.VARIANTS.items()
}


#: What the device raises, per fault kind: torch_npu's allocator message, and an ACL runtime error.
FAULT_MESSAGES = {
    "oom": "NPU out of memory. Tried to allocate 2.00 GiB (fake fault)",
    "runtime": "EZ9999: Inner Error! aclnn kernel launch failed (fake fault)",
}


class FaultPlan:
    """Raise out-of-memory or a runtime error on calls ``at`` .. ``at + times - 1`` (1-based, counted from injection)
    of a kernel (``inject``) or of a module's function (``proxy``); ``fired`` counts the raises per target."""

    def __init__(self) -> None:
        self._plans: dict[str, list[tuple[int, int, str]]] = {}
        self._seen: dict[str, int] = {}
        self.fired: dict[str, int] = {}

    def inject(self, target: str, *, at: int = 1, kind: str = "oom", times: int = 1) -> None:
        if kind not in FAULT_MESSAGES:
            raise KeyError(f"fault kind {kind!r}: one of {sorted(FAULT_MESSAGES)}")
        self._plans.setdefault(target, []).append((self._seen.get(target, 0) + at, times, kind))

    def check(self, target: str) -> None:
        """Count one call of ``target``; raise if a fault is planned for it."""
        n = self._seen[target] = self._seen.get(target, 0) + 1
        for first, times, kind in self._plans.get(target, ()):
            if first <= n < first + times:
                self.fired[target] = self.fired.get(target, 0) + 1
                raise RuntimeError(f"{target}: {FAULT_MESSAGES[kind]}")

    def proxy(self, module: Any, name: str) -> Any:
        """A stand-in for ``module`` whose ``name`` counts (and faults) as target ``name``; all else delegates."""
        plan, real = self, getattr(module, name)

        class _Proxy:
            def __getattr__(self, attr: str) -> Any:
                return getattr(module, attr)

        def faulting(*args: Any, **kwargs: Any) -> Any:
            plan.check(name)
            return real(*args, **kwargs)

        p = _Proxy()
        setattr(p, name, faulting)
        return p


def _counted(name: str, fn: Any, log: Counter[str], faults: FaultPlan, timing: TimingPlan) -> Any:
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        sig.bind(*args, **kwargs)  # a keyword the schema does not have fails like torch.ops.npu.* does (TypeError)
        log[name] += 1
        faults.check(name)
        timing.tick(name, args, kwargs)
        # one NPU launch for the op counter, whatever CPU ops the fake computes it with (testbed/npu_ops.py)
        return run_npu_kernel(name, fn, *args, **kwargs)

    wrapper.__name__ = name
    return wrapper


class FakeNpuConfig:
    """``torch.npu.config`` as torch_npu 2.13.0's ``_npuConfig`` [TNPU-CFG]: write-only; ``allow_internal_format``
    goes to the option store (``_C._npu_setOption``), any other attribute is dropped."""

    def __init__(self, c: types.SimpleNamespace) -> None:
        object.__setattr__(self, "_FakeNpuConfig__c", c)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "allow_internal_format":
            self.__c._npu_setOption({"ALLOW_INTERNAL_FORMAT": "enable" if value else "disable"})


def _option_store(initial: dict[str, str]) -> types.SimpleNamespace:
    """``torch_npu._C``'s option functions: ``_npu_setOption(dict)`` and ``_npu_getOption(name) -> bytes | None``."""
    options = dict(initial)
    return types.SimpleNamespace(
        options=options,
        _npu_setOption=lambda option: options.update({k: str(v) for k, v in option.items()}),
        _npu_getOption=lambda name: options[name].encode() if name in options else None,
    )


def build(
    *,
    allow_internal_format: bool = True,
    cann_version: str = "8.3.RC1",
    soc_version: int = 220,
    free_memory: int = 64 << 30,
    **variants: str,
) -> types.ModuleType:
    """A fresh fake ``torch_npu`` (not installed): ``allow_internal_format`` is the initial option (A2 True, A3 False
    [OP-AIF]), ``soc_version`` 220 = Ascend910B1; ``mod.memory``, ``mod.faults``, ``mod.timing`` are settable."""
    mod = types.ModuleType("torch_npu")
    mod.__fake__ = True  # type: ignore[attr-defined]
    # Another kernel is another build: the variants are part of the version (the saved verdicts' key holds it).
    wrong = sorted(f"{k}={v}" for k, v in variants.items() if v != "correct")
    mod.__version__ = "2.13.0+fake" + ("." + ".".join(wrong) if wrong else "")  # type: ignore[attr-defined]
    mod._C = _option_store({"ALLOW_INTERNAL_FORMAT": "enable" if allow_internal_format else "disable"})  # type: ignore[attr-defined]
    # calls per kernel (tests assert that a path was, or was not, taken), planned faults, device time
    log, faults, timing = Counter[str](), FaultPlan(), TimingPlan()
    mod.calls, mod.faults, mod.timing = log, faults, timing  # type: ignore[attr-defined]
    for kernel, impls in KERNELS.items():
        choice = variants.pop(kernel.removeprefix("npu_"), variants.pop(kernel, "correct"))
        if choice not in impls:
            raise KeyError(f"fake {kernel}: no variant {choice!r} (have {sorted(impls)})")
        setattr(mod, kernel, _counted(kernel, impls[choice], log, faults, timing))
    if variants:
        raise KeyError(f"unknown fake kernel variants: {variants}")
    mod.memory = memory = {"free": free_memory, "total": 64 << 30}  # type: ignore[attr-defined]
    mod._torch_npu_namespace = mod.npu = types.SimpleNamespace(  # type: ignore[attr-defined]
        is_available=lambda: True,
        device_count=lambda: 1,
        current_device=lambda: 0,
        synchronize=lambda *a, **k: None,
        Event=timing.event_class(),
        get_device_name=lambda *a, **k: "FakeAscend910B1",
        config=FakeNpuConfig(mod._C),  # type: ignore[attr-defined]
        utils=types.SimpleNamespace(get_cann_version=lambda module="CANN": cann_version),
        get_soc_version=lambda: soc_version,
        mem_get_info=lambda *a: (memory["free"], memory["total"]),
    )
    return mod


def install(monkeypatch: Any, *, timed: bool = False, **kwargs: Any) -> types.ModuleType:
    """Install a fake built with ``kwargs`` as ``torch_npu`` and ``torch.npu`` for a test; the plugin's kernel timing
    is off unless ``timed`` (tests of other things keep their call counts)."""
    from vllm_omni_ascend_opt import _backend
    from vllm_omni_ascend_opt.blocks.kernels import timing

    if not timed:
        monkeypatch.setenv(timing.ENV_TIMING, "0")

    mod = build(**kwargs)
    monkeypatch.setitem(sys.modules, "torch_npu", mod)
    monkeypatch.setattr(torch, "npu", mod._torch_npu_namespace, raising=False)
    formats.install_hooks(monkeypatch, mod)  # Tensor.is_npu, mod.mark_host, mod.Format
    _backend.reset_cache()
    monkeypatch.setattr(_backend, "_CACHE", {})
    return mod


@contextlib.contextmanager
def installed(**kwargs: Any) -> Iterator[types.ModuleType]:
    """:func:`install` for a ``with`` block outside pytest (the benchmarks that run through the fake)."""
    import pytest

    with pytest.MonkeyPatch.context() as mp:
        yield install(mp, **kwargs)
