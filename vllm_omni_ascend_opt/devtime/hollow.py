"""Run real model code on CPU tensors without computing anything: :class:`HollowMode`.

Tensors stay plain CPU tensors (meta ones would break device checks, host reads and the memo) and each op is answered
from its meta kernel: views and allocations run for real, in-place ops return their target unwritten, other outputs
are allocated uninitialised; ops without a meta kernel and small factories run for real.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

#: Outputs up to this many elements are filled (zeros / True) so that host reads of them are deterministic.
SMALL = 1 << 16
_REAL = {"aten::empty", "aten::empty_strided", "aten::set_", "aten::resize_", "aten::lift_fresh", "aten::detach"}


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.device.type == "cpu":
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, torch.device) and x.type == "cpu":
        return torch.device("meta")
    return x


def _materialize(t: Any) -> Any:
    if not isinstance(t, torch.Tensor) or t.device.type != "meta":
        return t
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
    if out.numel() <= SMALL:
        out.fill_(True if t.dtype == torch.bool else 0)
    return out


def _mutated(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What an in-place / ``out=`` op returns, without writing it."""
    schema = func._schema
    named = {**dict(zip([a.name for a in schema.arguments], args, strict=False)), **kwargs}
    written = [named.get(a.name) for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    written = [w for w in written if w is not None]
    if not schema.returns:
        return None
    if len(schema.returns) == 1:
        return written[0] if written else None
    return tuple(written)


class HollowMode(TorchDispatchMode):
    """``with HollowMode(): model(**inputs)``: the real Python code runs, no arithmetic does (module docstring)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name == "aten::equal":  # the memo's value checks see equal tensors, as in a repeated request
            return True
        if getattr(func, "is_view", False) or name in _REAL:
            return func(*args, **kwargs)
        if func._schema.is_mutable:
            return _mutated(func, args, kwargs)
        leaves = pytree.tree_leaves((args, kwargs))
        if not any(isinstance(x, torch.Tensor) for x in leaves):
            return self._factory(func, args, kwargs)
        meta_args, meta_kwargs = pytree.tree_map(_to_meta, (args, kwargs))
        try:
            out = func(*meta_args, **meta_kwargs)
        except Exception:  # value-dependent (no meta kernel): run on the deterministic values
            return func(*args, **kwargs)
        return pytree.tree_map(_materialize, out)

    @staticmethod
    def _factory(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A factory (``arange``, ``randn`` ...): made for real when small (values may be read), else unwritten."""
        has_device = any(a.name == "device" for a in func._schema.arguments)
        if has_device and kwargs.get("device") in (None, "cpu", torch.device("cpu")):
            try:
                meta = func(*args, **{**kwargs, "device": torch.device("meta")})
            except Exception:
                meta = None
            if isinstance(meta, torch.Tensor) and meta.numel() > SMALL:
                return torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype, device="cpu")
        return func(*args, **kwargs)
