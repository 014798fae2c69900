"""Two-segment modulation (Qwen-Image-Edit-2511, ``zero_cond_t``): each image token takes the current timestep's
modulation or timestep 0's, where stock builds ``[B, L, D]`` tensors with ``torch.where(modulate_index, ...)``.
:class:`SegmentPlan` reads ``modulate_index``'s runs once per forward; :class:`SegMod` multiplies ``[B, C, L/C, D]``
chunks by ``[B, C, 1, D]`` tensors, or each run's slice with ``out=``: the same IEEE ops on the same values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from vllm_omni_ascend_opt.blocks.body.block_body import ModeOwner, layernorm, use_residual
from vllm_omni_ascend_opt.blocks.weak_lru import tensor_bytes

#: At most this many equal chunks are modulated with one broadcast; more use per-segment slices.
MAX_BROADCAST_CHUNKS = 16


@dataclass(frozen=True, slots=True)
class SegmentPlan:
    """Where stock picks segment 0 or 1 along the (local) image sequence: ``runs`` ``(start, end, segment)`` of equal
    ``modulate_index != 0``, identical in every batch row."""

    length: int
    runs: tuple[tuple[int, int, int], ...]
    chunk: int  # tokens per chunk (gcd of the run lengths)

    @property
    def chunks(self) -> int:
        return self.length // self.chunk

    @property
    def broadcast(self) -> bool:
        return self.chunks <= MAX_BROADCAST_CHUNKS

    @staticmethod
    def of(index: torch.Tensor) -> SegmentPlan:
        """The plan of a ``[rows, L]`` modulate_index (one device->host copy); ValueError when rows differ."""
        if index.dim() != 2 or index.shape[1] == 0:
            raise ValueError(f"modulate_index of shape {tuple(index.shape)} is not [rows, L]")
        rows = index.tolist()  # one device->host copy, no kernel on the device
        if any(row != rows[0] for row in rows[1:]):
            raise ValueError("modulate_index differs between batch rows")
        values = [v != 0 for v in rows[0]]  # stock: index.to(dtype=torch.bool)
        runs: list[tuple[int, int, int]] = []
        start = 0
        for i in range(1, len(values) + 1):
            if i == len(values) or values[i] != values[start]:
                runs.append((start, i, int(values[start])))
                start = i
        return SegmentPlan(len(values), tuple(runs), math.gcd(*(b - a for a, b, _ in runs)))


@dataclass(slots=True)
class SegMod:
    """One two-segment image norm's modulation: ``first`` (``1 + scale``), ``shift`` and ``gate`` are
    ``[B, chunks, 1, D]`` for broadcast plans, else tuples by segment of ``[B, 1, D]``."""

    first: Any
    shift: Any
    gate: Any
    kind: str
    plan: SegmentPlan

    def _apply(self, y: torch.Tensor, mul: Any, add: Any | None) -> torch.Tensor:
        plan = self.plan
        b, n, d = y.shape
        if plan.broadcast:
            out = y.reshape(b, plan.chunks, plan.chunk, d) * mul
            if add is not None:
                out = out + add
            return out.view(b, n, d)
        out = torch.empty(y.shape, dtype=torch.promote_types(y.dtype, mul[0].dtype), device=y.device)
        for start, end, seg in plan.runs:
            part = out[:, start:end]
            torch.mul(y[:, start:end], mul[seg], out=part)
            if add is not None:
                part.add_(add[seg])
        return out

    def norm(self, norm: nn.Module, x: torch.Tensor, owner: ModeOwner | None, direct: Any = None) -> torch.Tensor:
        """Stock: ``norm(x, where(idx, scale1, scale0), where(idx, shift1, shift0))`` (``owner``: fast_modulate's;
        ``direct``: :func:`.direct_calls.decided`)."""
        if owner is not None:
            owner.count_stock("two-segment image norm (zero_cond_t): the modulation differs between segments")
        return self._apply(layernorm(self.kind, norm, x, direct), self.first, self.shift)

    def residual(self, x: torch.Tensor, y: torch.Tensor, owner: ModeOwner | None) -> torch.Tensor:
        """Stock's ``x + where(idx, gate1, gate0) * y``; with ``fast_residual`` one ``addcmul`` per broadcast/slice."""
        gate = self.gate if self.plan.broadcast else self.gate[0]
        if not use_residual(x, gate, y, owner):
            return x + self._apply(y, self.gate, None)  # where(idx, gate1, gate0) * y
        plan = self.plan
        b, n, d = y.shape
        if plan.broadcast:
            shape = (b, plan.chunks, plan.chunk, d)
            return torch.addcmul(x.reshape(shape), self.gate, y.reshape(shape)).view(b, n, d)
        out = torch.empty(y.shape, dtype=y.dtype, device=y.device)
        for start, end, seg in plan.runs:
            torch.addcmul(x[:, start:end], self.gate[seg], y[:, start:end], out=out[:, start:end])
        return out

    @staticmethod
    def segment(scale: torch.Tensor, shift: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One segment's ``(1 + scale, shift, gate)`` as contiguous ``[B, 1, D]``, from ``[B, D]`` projection views."""
        own = torch.contiguous_format
        return ((1 + scale).unsqueeze(1), shift.unsqueeze(1).clone(memory_format=own), gate.unsqueeze(1).clone())

    @staticmethod
    def build(per_seg: tuple[tuple[torch.Tensor, ...], ...], kind: str, plan: SegmentPlan) -> SegMod:
        """``per_seg[k]`` is :meth:`segment` of segment ``k`` (0: current timestep, 1: timestep 0)."""
        if plan.broadcast:
            order = [seg for start, end, seg in plan.runs for _ in range((end - start) // plan.chunk)]  # by chunk
            return SegMod(*(torch.stack([per_seg[k][j] for k in order], dim=1) for j in range(3)), kind, plan)
        return SegMod(*(tuple(per_seg[k][j] for k in (0, 1)) for j in range(3)), kind, plan)

    def nbytes(self, segment: int | None = None) -> int:
        """Bytes held; for slice plans ``segment`` counts only that segment's tensors."""
        mods = (self.first, self.shift, self.gate)
        return tensor_bytes(mods if self.plan.broadcast or segment is None else [x[segment] for x in mods])
