"""Count the kernels torch_npu 2.13 would launch for what runs here on CPU: :class:`NpuOpCounter`.

Per dispatched op (:func:`resolve`): registered for the NPU (:data:`REGISTERED_FILE`) directly or through its ``out=``
overload -> 1 launch; else its decomposition's pieces on meta tensors; else 1 launch, recorded as unresolved.
Composites torch_npu registers (:data:`FUNCTION_HOOKS`) and the torch_npu fake's ops count 1 each.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from vllm_omni_ascend_opt.testbed.opcount import OpCounter, is_kernel_launch

REGISTERED_FILE = Path(__file__).with_name("npu_registered_ops.txt")
#: Dispatch keys whose kernels run for a dense NPU tensor.
_DENSE_KEYS = {"PrivateUse1", "AutogradPrivateUse1"}
_MAX_DEPTH = 8  # decomposition recursion guard


@functools.cache
def registered_ops() -> frozenset[str]:
    """Overloads (``"add.Tensor"``, ``"_to_copy"`` for ``default``) with a dense NPU kernel in torch_npu 2.13.0."""
    rows = (line.split() for line in REGISTERED_FILE.read_text().splitlines() if line and not line.startswith("#"))
    return frozenset(name for name, keys in rows if _DENSE_KEYS & set(keys.split(",")))


def overload_name(func: Any) -> str:
    """``aten.add.Tensor`` -> ``"add.Tensor"``, ``aten._to_copy.default`` -> ``"_to_copy"`` (the yaml spelling)."""
    base = func._schema.name.split("::", 1)[-1]
    ov = func._overloadname
    return base if ov == "default" else f"{base}.{ov}"


def _non_out_args(schema: Any) -> list[tuple[str, str]]:
    return [(a.name, str(a.type)) for a in schema.arguments if not a.is_out]


def _out_variant(func: Any) -> str | None:
    """The registered ``out=`` overload a structured functional/in-place ``func`` delegates to, if any."""
    qualified = func._schema.name + ("" if func._overloadname == "default" else f".{func._overloadname}")
    if not torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CompositeExplicitAutogradNonFunctional"):
        return None
    packet = getattr(torch.ops.aten, func._schema.name.split("::", 1)[-1].rstrip("_"), None)
    if packet is None:
        return None
    want = _non_out_args(func._schema)
    for ov in packet.overloads():
        cand = getattr(packet, ov)
        if any(a.is_out for a in cand._schema.arguments) and _non_out_args(cand._schema) == want:
            full = overload_name(cand)
            if full in registered_ops():
                return full
    return None


@functools.cache
def resolve(func: Any) -> tuple[str, Any]:
    """How ``func`` runs on the NPU: ``("none", None)``, ``("kernel", name)`` one launch (every non-aten op too),
    ``("decompose", fn)`` the pieces of ``fn``, ``("unresolved", name)`` one launch we cannot account for."""
    if not is_kernel_launch(func):
        return ("none", None)
    name = overload_name(func)
    if not func._schema.name.startswith("aten::"):
        return ("kernel", func._schema.name)
    if name in registered_ops():
        return ("kernel", name)
    out = _out_variant(func)
    if out is not None:  # counted under the functional's name: one launch of ``out``
        return ("kernel", name)
    decomp = torch._decomp.decomposition_table.get(func)
    if decomp is not None:
        return ("decompose", decomp)
    if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
        return ("decompose", func.decompose)  # reaches a mode under inference_mode: run its composite kernel
    return ("unresolved", name)


#: Python callable -> the composite overload it dispatches to (effective where torch_npu registers that overload).
FUNCTION_HOOKS: dict[Callable[..., Any], str] = {
    F.scaled_dot_product_attention: "scaled_dot_product_attention",
    torch.matmul: "matmul",
    torch.Tensor.matmul: "matmul",
    torch.Tensor.__matmul__: "matmul",
    torch.softmax: "softmax.int",
    torch.Tensor.softmax: "softmax.int",
    F.softmax: "softmax.int",
}


class _State(threading.local):
    def __init__(self) -> None:
        self.active: list[NpuOpCounter] = []
        self.suspended = 0


_STATE = _State()


@contextlib.contextmanager
def _suspended() -> Iterator[None]:
    _STATE.suspended += 1
    try:
        yield
    finally:
        _STATE.suspended -= 1


def _record(name: str, call: tuple[tuple[Any, ...], dict[str, Any], Any] | None = None) -> None:
    """Count one launch of ``name`` in every active counter (only the innermost isolated one) and observe it."""
    active = _STATE.active
    targets = active[-1:] if active and active[-1]._isolated else active
    for c in targets:
        if c.enabled:
            c.counts[name] += 1
            c.observe(name, call)


def run_npu_kernel(name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run the fake torch_npu kernel ``fn`` as ONE launch ``npu::<name>`` (none for a tensor-free result)."""
    if _STATE.suspended or not _STATE.active:
        return fn(*args, **kwargs)
    with _suspended():
        out = fn(*args, **kwargs)
    if any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(out)):
        _record(f"npu::{name}", (args, kwargs, out))
    return out


class _FunctionHooks(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = FUNCTION_HOOKS.get(func)
        if op is None or _STATE.suspended or op not in registered_ops():
            return func(*args, **kwargs)
        with _suspended():
            out = func(*args, **kwargs)
        _record(op, (args, kwargs, out))  # nested counters' hook modes are popped while this runs: count in all here
        return out


class NpuOpCounter(OpCounter):
    """``with NpuOpCounter() as c: ...`` then ``c.total`` / ``c.counts`` (by overload name, ``"mul.Tensor"``), also
    ``c.decomposed`` (ran as their pieces) and ``c.unresolved`` (counted 1 without an NPU kernel; should stay empty)."""

    def __init__(self, *, _isolated: bool = False, _depth: int = 0) -> None:
        super().__init__()
        self.decomposed: Counter[str] = Counter()
        self.unresolved: Counter[str] = Counter()
        self._isolated = _isolated  # a decomposition's sub-counter: its pieces run on meta, unseen by outer modes
        self._depth = _depth
        self._hooks = _FunctionHooks()

    def __enter__(self):
        _STATE.active.append(self)
        self._hooks.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._hooks.__exit__(*exc)
            _STATE.active.remove(self)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._isolated:
            self._count(func, args, kwargs)
            with _disable_current_modes():
                return func(*args, **kwargs)
        if self.enabled and not _STATE.suspended:
            self._count(func, args, kwargs)
        return func(*args, **kwargs)

    def observe(self, name: str, call: tuple[tuple[Any, ...], dict[str, Any], Any] | None) -> None:
        """One launch of ``name`` was counted, with its ``(args, kwargs, result)`` when known (for subclasses)."""

    def absorb(self, pieces: NpuOpCounter) -> None:
        """A decomposition's sub-counter ``pieces`` was merged into this one; a subclass takes what it recorded."""

    def _count(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        how, what = resolve(func)
        if how == "none":
            return
        if how == "decompose":
            pieces = self._pieces(what, args, kwargs) if self._depth < _MAX_DEPTH else None
            if pieces is not None:
                self.decomposed[overload_name(func)] += 1
                self.counts.update(pieces.counts)
                self.decomposed.update(pieces.decomposed)
                self.unresolved.update(pieces.unresolved)
                self.absorb(pieces)
                return
        if how != "kernel":  # unresolved, or a decomposition that could not run: one launch we cannot account for
            what = overload_name(func)
            self.unresolved[what] += 1
        self.counts[what] += 1
        self.observe(what, (args, kwargs, None))

    def _pieces(self, decomp: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> NpuOpCounter | None:
        """Run ``decomp`` on meta copies of the arguments under an isolated sub-counter; None if it cannot run."""
        with _disable_current_modes():
            meta_args, meta_kwargs = pytree.tree_map_only(
                torch.Tensor,
                lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta"),
                (args, kwargs),
            )
        sub = type(self)(_isolated=True, _depth=self._depth + 1)  # a subclass's pieces are its own
        try:
            with sub:
                decomp(*meta_args, **meta_kwargs)
        except Exception:  # a decomposition that needs values (data-dependent) cannot run on meta
            return None
        return sub
