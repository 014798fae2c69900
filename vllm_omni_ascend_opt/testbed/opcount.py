"""Count kernel-launching aten ops (what an NPU pays a launch for, a CPU hides), excluding views and allocation-only
ops; host syncs and reads of given tensors. What torch_npu itself would launch: :class:`~.npu_ops.NpuOpCounter`."""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from unittest import mock

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

# Ops that allocate or re-describe memory without launching a compute kernel.
_NO_KERNEL = {
    "aten::empty",
    "aten::empty_strided",
    "aten::empty_like",
    "aten::lift_fresh",
    "aten::detach",
    "aten::alias",
    "aten::_local_scalar_dense",
    "aten::is_nonzero",
    "aten::sym_size",
    "aten::sym_stride",
    "aten::sym_numel",
    "aten::sym_storage_offset",
    "aten::set_",
    "aten::resize_",
}


def is_kernel_launch(func: Any) -> bool:
    """True when ``func`` (an OpOverload) would launch a device kernel: not a view, not allocation-only."""
    return func._schema.name not in _NO_KERNEL and not getattr(func, "is_view", False)


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as c: ...`` then ``c.total`` / ``c.counts`` (by op name)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.enabled = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.enabled and is_kernel_launch(func):
            self.counts[func._schema.name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def count_ops(fn: Callable[[], Any]) -> tuple[Any, OpCounter]:
    with OpCounter() as c:
        out = fn()
    return out, c


@contextlib.contextmanager
def count_module_calls(module: torch.nn.Module, counter: Callable[[], Any] | None = None) -> Iterator[list[OpCounter]]:
    """Yields a list that receives one counter (made by ``counter``) per call of ``module``."""
    results: list[OpCounter] = []
    active: list[OpCounter] = []
    make = counter or OpCounter

    def pre(_m, _a, _k=None):
        c = make()
        c.__enter__()
        active.append(c)

    def post(_m, _a, _o, _k=None):
        c = active.pop()
        c.__exit__(None, None, None)
        results.append(c)

    with module.register_forward_pre_hook(pre), module.register_forward_hook(post):
        yield results


class TensorReadCounter(TorchDispatchMode):
    """``with TensorReadCounter(weights) as c: ...``: ``c.calls`` kernel-launching ops reading any of them (by storage:
    views count) and ``c.bytes``, each watched storage's size once per op that takes it."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self._sizes = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        self.calls = 0
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_kernel_launch(func):
            seen = {
                a.untyped_storage().data_ptr()
                for a in pytree.tree_leaves((args, kwargs))
                if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in self._sizes
            }
            if seen:
                self.calls += 1
                self.bytes += sum(self._sizes[p] for p in seen)
        return func(*args, **kwargs)


#: Tensor methods that make the host wait for the device (read values back), counted by :class:`SyncCounter`.
SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__")
#: Aten ops that return a host value (what ``item()``, ``bool(t)``, ``float(t)``, ``torch.equal`` dispatch).
SYNC_OPS = {"aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal"}


def call_site(
    depth: int = 2, skip: tuple[str, ...] = (), skip_functions: tuple[str, ...] = (), function: bool = True
) -> str:
    """``file:line (function)`` (without ``function``: ``file:line``) of the nearest caller from ``depth`` frames up
    outside torch, contextlib, this module, paths containing one of ``skip`` and functions in ``skip_functions``."""
    f = sys._getframe(depth)
    while f is not None:
        name = f.f_code.co_filename
        if (
            name != __file__
            and "/torch/" not in name
            and "/contextlib.py" not in name
            and not any(s in name for s in skip)
            and f.f_code.co_name not in skip_functions
        ):
            short = name.split("/site-packages/")[-1].split("/vllm_omni_ascend_opt/")[-1]
            return f"{short}:{f.f_lineno}" + (f" ({f.f_code.co_name})" if function else "")
        f = f.f_back
    return "?"


class SyncCounter(TorchDispatchMode):
    """``with SyncCounter() as s: ...`` then ``s.total`` and ``s.sites`` (per call site): host syncs, calls of
    :data:`SYNC_METHODS` and :data:`SYNC_OPS`; a read of a ``.cpu()`` copy in the same frame is not counted again."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter[str] = Counter()
        self._depth = 0
        self._host_copy: tuple[Any, int] | None = None  # (caller frame, storage pointer) of the last .cpu()
        self._patches = contextlib.ExitStack()

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def _wrap(self, name: str, original: Any) -> Any:
        counter = self

        def method(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if counter._depth:
                return original(t, *args, **kwargs)
            frame = sys._getframe(1)
            ptr = t.untyped_storage().data_ptr() if t.device.type != "meta" else -1
            host = counter._host_copy
            # not a read of the host copy made by .cpu() in this frame
            if name == "cpu" or host is None or host[0] is not frame or host[1] != ptr:
                counter.sites[call_site(2)] += 1
            counter._depth += 1
            try:
                out = original(t, *args, **kwargs)
            finally:
                counter._depth -= 1
            if name == "cpu" and isinstance(out, torch.Tensor):
                counter._host_copy = (frame, out.untyped_storage().data_ptr())
            return out

        method.__name__ = name
        return method

    def __enter__(self) -> SyncCounter:
        for name in SYNC_METHODS:
            wrapped = self._wrap(name, getattr(torch.Tensor, name))
            self._patches.enter_context(mock.patch.object(torch.Tensor, name, wrapped))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            self._patches.close()
            self._host_copy = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._depth and func._schema.name in SYNC_OPS:
            self.sites[call_site(2)] += 1
        self._depth += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self._depth -= 1
