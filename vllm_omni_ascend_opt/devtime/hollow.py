"""Run real model code on CPU tensors without computing anything: :class:`HollowMode`.

The device-time trace needs every op the real ``QwenImageTransformer2DModel`` (60 blocks, hidden 3072) and the real
VAE decoder launch at 1328x1328, with its shapes, but not its numbers. Meta tensors give shapes, yet the code under
trace reads device types (``torch.is_autocast_enabled("meta")`` fails) and a few host values (stock's
``mask.all()``, the modulation memo's digest of the timestep embedding, the kernel checks' error bounds), and
``FakeTensor`` is refused by the memo (``type(temb) is not torch.Tensor``). So the tensors stay plain CPU tensors and
each op is answered from its meta kernel instead of being computed:

* views and allocation-only ops run for real (no arithmetic);
* in-place and ``out=`` ops return the tensor they would write, unwritten;
* every other op runs on meta copies of its arguments, and its outputs are allocated, uninitialised, with the meta
  result's shape, stride and dtype: large ones are never touched (the pages are never faulted in), small ones
  (:data:`SMALL` elements) are filled with zeros (``True`` for ``bool``), so what the host reads is deterministic;
* an op no meta kernel answers (value-dependent) runs for real on those deterministic values;
* factories run for real when their result is small, and are allocated unwritten when it is large.

So every value the host reads is 0, ``False`` is never seen where a ``bool`` reduction is taken, and ``torch.equal``
answers True: each kernel check the plugin makes on first use passes (its errors are 0), data-dependent branches go
the way a normal request goes (an all-ones text mask), and the memo sees the same timestep embedding twice. What the
trace shows is the path of a request on which every verified kernel was accepted; ``tests/test_devtime.py`` checks
that its launch count equals the counter's on real values.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

#: Outputs up to this many elements are filled (zeros / True) so that host reads of them are deterministic.
SMALL = 1 << 16
_REAL = {"aten::empty", "aten::empty_strided", "aten::set_", "aten::resize_", "aten::lift_fresh", "aten::detach"}
_ALWAYS_TRUE = {"aten::equal"}


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
    named = dict(zip([a.name for a in schema.arguments], args, strict=False))
    named.update(kwargs)
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
        if name in _ALWAYS_TRUE:
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
        """A factory (``arange``, ``zeros``, ``randn`` ...): made for real when small (its values may be read),
        allocated unwritten when large (the kernel checks' random probes at full size)."""
        has_device = any(a.name == "device" for a in func._schema.arguments)
        if has_device and kwargs.get("device") in (None, "cpu", torch.device("cpu")):
            try:
                meta = func(*args, **{**kwargs, "device": torch.device("meta")})
            except Exception:
                meta = None
            if isinstance(meta, torch.Tensor) and meta.numel() > SMALL:
                return torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype, device="cpu")
        return func(*args, **kwargs)
