"""An op trace of the real model at full scale, with no memory: what each launch costs in FLOPs and bytes.

:class:`OpTrace` is the NPU launch counter that also prices each launch (:mod:`.costs`) by scope (outside the blocks,
first block, last block) and source line. :func:`trace_transformer` and :func:`trace_vae` trace one warm call under
:class:`~.hollow.HollowMode`; 60 blocks are ``outside + first + 59 x last``. The caller installs the torch_npu fake.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from vllm_omni_ascend_opt.devtime.costs import cost
from vllm_omni_ascend_opt.devtime.hollow import HollowMode
from vllm_omni_ascend_opt.testbed.blockops import new_transformer, npu_dispatch, t2i_inputs
from vllm_omni_ascend_opt.testbed.npu_ops import NpuOpCounter
from vllm_omni_ascend_opt.testbed.opcount import call_site
from vllm_omni_ascend_opt.testbed.tiny_model import REALWIDTH, ModelSpec

#: Qwen-Image's real transformer and VAE sizes (the trace builds ``depth`` of the 60 blocks).
FULL = dataclasses.replace(
    REALWIDTH, name="full", num_layers=60, joint_attention_dim=3584, vae_z_dim=16, vae_base_dim=96
)
BLOCKS = FULL.num_layers
#: Text tokens of the prompt (without the template's prefix): assumed, the reference's prompt is not published.
TEXT_TOKENS = 64
#: Frames skipped when looking for the model or plugin line an op came from.
_SKIP_FRAMES = ("/devtime/", "/testbed/npu_ops.py", "/fake_torch_npu/")


@dataclass
class Op:
    """``count`` launches of ``name`` at ``site`` (``file:line`` of the model or plugin code, ``|``, the shapes)."""

    name: str
    kind: str
    site: str
    count: int = 0
    flops: float = 0.0
    bytes: float = 0.0


@dataclass
class OpTable:
    """Launches aggregated by (kernel, call site and shapes): ``ops[(name, site)]``."""

    ops: dict[tuple[str, str], Op] = field(default_factory=dict)

    def add(self, name: str, kind: str, site: str, flops: float, nbytes: float, count: int = 1) -> None:
        op = self.ops.get((name, site))
        if op is None:
            op = self.ops[(name, site)] = Op(name, kind, site)
        op.count += count
        op.flops += flops
        op.bytes += nbytes

    def merge(self, other: OpTable, times: int = 1) -> None:
        for op in other.ops.values():
            self.add(op.name, op.kind, op.site, op.flops * times, op.bytes * times, op.count * times)

    @property
    def launches(self) -> int:
        return sum(o.count for o in self.ops.values())

    @property
    def flops(self) -> float:
        return sum(o.flops for o in self.ops.values())

    def to_list(self) -> list[list[Any]]:
        return [[o.name, o.kind, o.site, o.count, o.flops, o.bytes] for o in self.ops.values()]

    @classmethod
    def from_list(cls, rows: list[list[Any]]) -> OpTable:
        t = cls()
        for name, kind, site, count, flops, nb in rows:
            t.add(name, kind, site, flops, nb, count)
        return t


class OpTrace(NpuOpCounter):
    """The NPU launch counter, pricing each launch it counts into ``tables[scope]`` (``scope`` set by the caller)."""

    def __init__(self, *, _isolated: bool = False, _depth: int = 0) -> None:
        super().__init__(_isolated=_isolated, _depth=_depth)
        self.scope = "outside"
        self.tables: dict[str, OpTable] = defaultdict(OpTable)
        self._pending: list[tuple[str, str, tuple[Any, ...], dict[str, Any]]] = []

    def observe(self, name: str, call: tuple[tuple[Any, ...], dict[str, Any], Any] | None) -> None:
        args, kwargs, out = call if call is not None else ((), {}, None)
        site = call_site(3, _SKIP_FRAMES, ("__torch_function__",), function=False)
        if out is None:  # an aten kernel counted before it ran: priced once its result exists
            self._pending.append((name, site, args, kwargs))
        else:
            self._price(name, site, args, kwargs, out)

    def _price(self, name: str, site: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        c = cost(name, args, kwargs, out)
        leaves = pytree.tree_leaves((args, kwargs))  # "1x3584x3072,3072x3072": ops are merged only when equal
        dims = ",".join("x".join(map(str, t.shape)) for t in leaves if isinstance(t, torch.Tensor))
        self.tables[self.scope].add(name, c.kind, f"{site}|{dims}", c.flops, c.bytes)

    def absorb(self, pieces: NpuOpCounter) -> None:
        if isinstance(pieces, OpTrace):
            for table in pieces.tables.values():
                self.tables[self.scope].merge(table)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        mark = len(self._pending)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        pending, self._pending = self._pending[mark:], self._pending[:mark]
        for name, site, a, k in pending:
            self._price(name, site, a, k or {}, out)
        return out


@contextlib.contextmanager
def _scopes(trace: OpTrace, blocks: Any) -> Iterator[None]:
    """Set ``trace.scope`` to ``first`` / ``last`` while the first / last block runs, ``outside`` otherwise."""

    def post(_m, _a, _o):
        trace.scope = "outside"

    with contextlib.ExitStack() as hooks:
        for i, blk in enumerate(blocks):
            scope = "first" if i == 0 else "last" if i == len(blocks) - 1 else "middle"

            def pre(_m, _a, _s=scope):
                trace.scope = _s

            hooks.enter_context(blk.register_forward_pre_hook(pre))
            hooks.enter_context(blk.register_forward_hook(post))
        yield


@dataclass
class CallTrace:
    """One warm transformer call (or one VAE decode): its op tables by scope."""

    tables: dict[str, OpTable]

    def per_call(self, blocks: int = BLOCKS) -> OpTable:
        """The whole call at ``blocks`` blocks: outside + first block + (blocks - 1) x the last block."""
        out = OpTable()
        out.merge(self.tables.get("outside", OpTable()))
        last = self.tables.get("last")  # None: a VAE decode, or a depth-1 model
        out.merge(self.tables.get("first", OpTable()), 1 if last else blocks)
        if last:
            out.merge(last, blocks - 1)
        return out

    @property
    def block(self) -> OpTable:
        return self.tables.get("last") or self.tables.get("first") or OpTable()


def build_transformer(rt: Any, spec: ModelSpec = FULL, depth: int = 2) -> Any:
    """vLLM-Omni's transformer for ``spec`` at ``depth`` blocks, bf16, with uninitialised weights (nothing computed)."""
    spec = dataclasses.replace(spec, num_layers=depth)
    return new_transformer(rt, spec, torch.bfloat16, HollowMode()).eval()


def transformer_inputs(tr: Any, height: int, width: int, batch: int = 1, text_tokens: int = TEXT_TOKENS) -> dict:
    """:func:`~.blockops.t2i_inputs` at ``height`` x ``width`` pixels in bf16, made under :class:`HollowMode`."""
    with HollowMode():
        return t2i_inputs(tr, torch.bfloat16, height, width, batch, text_tokens)


def _trace(rt: Any, model: Any, flags: str, run: Any, blocks: Any = (), npu: bool = False) -> CallTrace:
    """Select ``flags`` on ``model``, ``run()`` cold, trace a warm ``run()`` (``npu``: under ``npu_dispatch``)."""
    from vllm_omni_ascend_opt import api

    hollow = HollowMode()  # selecting too: attaching casts or copies weights (nz_weights), nothing computed
    with hollow:
        api.select(flags, model=model)
    try:
        with hollow, npu_dispatch(model) if npu else contextlib.nullcontext(), rt.context(), torch.no_grad():
            run()  # cold: memo and tables filled, first-use kernel checks done
            t = OpTrace()
            with _scopes(t, blocks), t:
                run()
    finally:
        with hollow:
            api.select("none", model=model)
    return CallTrace(dict(t.tables))


def trace_transformer(rt: Any, tr: Any, flags: str, kw: dict[str, Any]) -> CallTrace:
    """Trace one warm transformer call with ``flags`` (:func:`_trace`)."""
    return _trace(rt, tr, flags, lambda: tr(**kw), tr.transformer_blocks, npu=True)


def build_vae() -> Any:
    """vLLM-Omni's distributed Qwen-Image VAE at the real size (base 96, z 16), bf16, uninitialised."""
    from vllm_omni.diffusion.distributed.autoencoders.autoencoder_kl_qwenimage import DistributedAutoencoderKLQwenImage

    with HollowMode():
        vae = DistributedAutoencoderKLQwenImage(**FULL.vae_kwargs())
    return vae.to(torch.bfloat16).eval()


def trace_vae(rt: Any, vae: Any, flags: str, height: int, width: int, batch: int = 1) -> CallTrace:
    """Trace one VAE decode of a ``height`` x ``width`` image (latents ``[B, z, 1, H/8, W/8]``) with ``flags``."""
    with HollowMode():
        z = torch.empty(batch, vae.config.z_dim, 1, height // 8, width // 8, dtype=torch.bfloat16)
    return _trace(rt, vae, flags, lambda: vae.decode(z, return_dict=False))
