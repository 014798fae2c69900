"""Multi-card layouts for one image: the collectives each parallel mode issues, priced, and the best layout.

:func:`collectives` is what vLLM-Omni's Ulysses, ring, TP and CFG-parallel modes issue (checked against
:class:`CollectiveCounter` on the real code). Pricing (approximate): an all-to-all or all-gather over u ranks moves
its (u-1)/u share over u-1 links at once, an all-reduce twice that, plus one latency per collective; ring passes are
not overlapped; compute is one rank's share of the ops (:func:`_rank_table`).
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_omni_ascend_opt.devtime import model as M
from vllm_omni_ascend_opt.devtime import table as TB
from vllm_omni_ascend_opt.devtime.costs import ATTENTION, GEMM, nbytes
from vllm_omni_ascend_opt.devtime.specs import HCCL_LATENCY_US
from vllm_omni_ascend_opt.devtime.trace import BLOCKS, FULL, OpTable

HIDDEN, HEADS, HEAD_DIM = FULL.inner_dim, FULL.num_attention_heads, FULL.attention_head_dim
LINKS = 7
#: The input argument of each c10d op whose bytes are counted (what one rank sends in).
_INPUT_ARG = {
    "alltoall_base_": "input",
    "allreduce_": "tensors",
    "allgather_": "input_tensors",
    "_allgather_base_": "input_tensor",
    "send": "tensors",
}


class CollectiveCounter(TorchDispatchMode):
    """``with CollectiveCounter() as c: ...``: the ``c10d::`` collectives, by name: ``c.calls``, ``c.bytes`` in."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns, _, name = func._schema.name.partition("::")
        if ns == "c10d" and name not in ("barrier", "monitored_barrier_"):
            named = {**dict(zip([a.name for a in func._schema.arguments], args, strict=False)), **kwargs}
            arg = named.get(_INPUT_ARG.get(name, ""), args[1] if len(args) > 1 else args[0])
            self.calls[name] += 1
            self.bytes[name] += sum(nbytes(t) for t in pytree.tree_leaves(arg) if isinstance(t, torch.Tensor))
        return func(*args, **kwargs)

    def as_dict(self) -> dict[str, list[int]]:
        return {n: [self.calls[n], self.bytes[n]] for n in self.calls}


@dataclass(frozen=True)
class Layout:
    ulysses: int = 1
    ring: int = 1
    cfg: int = 1
    tp: int = 1

    @property
    def cards(self) -> int:
        return self.ulysses * self.ring * self.cfg * self.tp

    @property
    def name(self) -> str:
        parts = (("USP", self.ulysses), ("ring", self.ring), ("CFG", self.cfg), ("TP", self.tp))
        return "+".join(f"{k}{v}" for k, v in parts if v > 1) or "1 card"


def collectives(
    layout: Layout,
    *,
    batch: int,
    image_tokens: int,
    text_tokens: int,
    blocks: int = BLOCKS,
    hidden: int = HIDDEN,
    channels: int = 64,
    el: int = 2,
) -> dict[str, list[int]]:
    """Per rank and transformer call of the SP and TP modes: ``c10d`` op -> [calls, bytes sent in] (``send``: a ring
    pass); ``el`` bytes per element, ``channels`` of the packed latent output."""
    out: dict[str, list[int]] = {}

    def add(name: str, calls: int, nbytes: int) -> None:
        got = out.setdefault(name, [0, 0])
        got[0] += calls
        got[1] += nbytes

    sp = layout.ulysses * layout.ring
    local = batch * (image_tokens // sp) * hidden * el
    if layout.ulysses > 1:  # q, k, v in and the output back; the text stream's output gathered once per block
        add("alltoall_base_", 4 * blocks, 4 * blocks * local)
        add("allgather_", blocks, blocks * batch * (text_tokens // layout.ulysses) * hidden * el)
    if layout.ring > 1:  # per block r-1 passes of the local k and v
        add("send", 2 * (layout.ring - 1) * blocks, 2 * (layout.ring - 1) * blocks * local)
    if sp > 1:  # the output all-gathered once per call
        add("_allgather_base_", 1, batch * (image_tokens // sp) * channels * el)
    if layout.tp > 1:  # per block an all-reduce after each stream's attention out-projection and MLP down-projection
        add("allreduce_", 4 * blocks, 2 * blocks * batch * (image_tokens + text_tokens) * hidden * el)
    return out


def cfg_collectives(*, batch: int, image_tokens: int, channels: int = 64, el: int = 2) -> dict[str, list[int]]:
    """CFG-parallel, per denoise step: one all-gather of the noise prediction."""
    return {"_allgather_base_": [1, batch * image_tokens * channels * el]}


def _comm_ms(
    name: str, calls: int, nbytes: int, ranks: int, hccs_gbps: float, latency_us: float = HCCL_LATENCY_US
) -> float:
    if ranks <= 1 or not calls:
        return 0.0
    link = hccs_gbps / LINKS * 1e9
    lanes = min(ranks - 1, LINKS)
    share = nbytes * (ranks - 1) / ranks
    factor = {"allreduce_": 2.0, "send": float(lanes)}.get(name, 1.0)  # a ring pass uses one link
    return (calls * latency_us * 1e-6 + factor * share / (lanes * link)) * 1e3


def _rank_table(table: OpTable, layout: Layout, image_tokens: int, batch: int) -> OpTable:
    """One rank's ops: SP splits those on the image sequence, TP the GEMMs, attention and head-split ops."""
    sp, tp = layout.ulysses * layout.ring, layout.tp
    seq = re.compile(rf"(^|[x,]){image_tokens}(x|,|$)")
    heads = f"x{HEADS}x{HEAD_DIM}"
    out = OpTable()
    for o in table.ops.values():
        shapes = o.site.split("|", 1)[-1]
        scale = 1.0
        if sp > 1 and (seq.search(shapes) or o.kind == ATTENTION):
            scale /= sp
        if tp > 1 and (o.kind in (GEMM, ATTENTION) or heads in shapes):
            scale /= tp
        out.add(o.name, o.kind, o.site, o.flops * scale, o.bytes * scale, o.count)
    return out


def predict(
    table: dict[str, Any],
    params: M.Params,
    layout: Layout,
    config: str,
    height: int,
    width: int,
    steps: int,
    cfg_forwards: int = 2,
    latency_us: float = HCCL_LATENCY_US,
) -> dict[str, float]:
    """Predicted ms of one image with ``layout`` (model). CFG-parallel needs ``cfg_forwards`` = 2."""
    wk = TB.workload_key(height, width, 1)
    tr, vae = TB.call_ops(table, wk, config), TB.call_ops(table, wk, config, "vae")
    s, t = (height // 16) * (width // 16), table["text_tokens"]
    rank_call = M.call_ms(_rank_table(tr, layout, s, 1), params)
    sp, gbps = layout.ulysses * layout.ring, params.spec.hccs_gbps
    calls = collectives(layout, batch=1, image_tokens=s, text_tokens=t).items()
    comm = sum(_comm_ms(n, c, b, layout.tp if n == "allreduce_" else sp, gbps, latency_us) for n, (c, b) in calls)
    forwards = cfg_forwards // layout.cfg
    step = forwards * (rank_call + comm)
    if layout.cfg > 1:
        ((c, b),) = cfg_collectives(batch=1, image_tokens=s).values()
        step += _comm_ms("_allgather_base_", c, b, 2, gbps)
    total = steps * step + M.call_ms(vae, params) + params.const_ms
    return {"ms": total, "comm_ms_per_step": forwards * comm, "compute_ms_per_call": rank_call}


def layouts_for(cards: int, cfg: bool) -> list[Layout]:
    grid = (Layout(*g) for g in itertools.product((1, 2, 4, 8), (1, 2, 4, 8), (1, 2), (1, 2, 4, 8)))
    return [lay for lay in grid if lay.cards == cards and (cfg or lay.cfg == 1) and HEADS % (lay.ulysses * lay.tp) == 0]


def text_table(
    table: dict[str, Any], params: M.Params, height: int, width: int, steps: int, cards: list[int], cfg: bool = True
) -> list[str]:
    fw = 2 if cfg else 1

    def both(lay: Layout) -> list[dict[str, float]]:  # stock's and default's predictions
        return [predict(table, params, lay, c, height, width, steps, fw) for c in ("stock", "default")]

    lines = [
        f"  multi-card layouts ({M.LABEL}), {width}x{height}, {steps} steps, CFG {'on' if cfg else 'off'}, "
        f"{params.spec.name}, HCCS {params.spec.hccs_gbps:.0f} GB/s (approximate), {HCCL_LATENCY_US:.0f} us per "
        "collective (assumed):"
    ]
    one = {c: predict(table, params, Layout(), c, height, width, steps, fw)["ms"] for c in ("stock", "default")}
    lines.append(f"    1 card: stock {one['stock']:.0f} ms, default {one['default']:.0f} ms")
    for n in cards:
        rows = sorted(((lay, *both(lay)) for lay in layouts_for(n, cfg)), key=lambda r: r[2]["ms"])
        for lay, st, de in rows:
            lines.append(
                f"    {n} cards {lay.name:<16} stock {st['ms']:7.0f} ms (x{one['stock'] / st['ms']:.2f})  default "
                f"{de['ms']:7.0f} ms (x{one['default'] / de['ms']:.2f})  comm {de['comm_ms_per_step']:6.1f} ms/step"
            )
        if rows:
            lines.append(f"    best for {n} cards: {rows[0][0].name}")
    return lines
