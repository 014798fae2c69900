"""``vllm-omni-ascend-opt warmup``: check, once per machine, the kernel shape classes that requests will hit, and
save the verdicts (``blocks/kernels/saved.py``), so that a server's first request runs no check.

The classes of Qwen-Image's transformer (24 heads of 128, bf16) at each ``--sizes`` (image tokens (H/16) x (W/16)),
``--batch`` and text-length bucket of ``--text``, as the default stack runs them: ``rope`` on the image, text and
joint sequences before Ulysses' all-to-all (split over ``--sp`` ranks); ``qk_norm`` on the image and text rows;
``fused_attention`` on the joint sequence after it (heads / sp), unmasked and, at batch 2, with a key mask. Each check
runs through the optimization's own code (``warm``), inside its guard: a fault is reported, not raised.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any

import torch

from vllm_omni_ascend_opt import _backend, registry
from vllm_omni_ascend_opt.blocks.kernels import npu_attention, rms_norm, rotary, saved

DEFAULT_TEXT = (64, 128, 256, 512)
#: What one check came to (a fault, a deferral and a missing kernel all leave the class unverified, retried later).
VERIFIED, REFUSED, UNVERIFIED = "verified", "refused", "fault, deferred or no kernel"


@dataclass
class Row:
    kernel: str
    shape: str
    outcome: str
    seconds: float
    #: the class verdict's timing (stock_ms, candidates: name -> ms or None, candidate: the choice), or None
    timing: dict[str, Any] | None = None

    def text(self) -> str:
        line = f"{self.kernel:<22} {self.shape:<40} {self.outcome:<9} {self.seconds:6.2f} s"
        if not (t := self.timing):
            return line
        ms = "  ".join(f"{n} {'refused' if v is None else f'{v:.4g} ms'}" for n, v in t["candidates"].items())
        return f"{line}  stock {t['stock_ms']:.4g} ms | {ms} -> {t.get('candidate') or 'stock'}"


def parse_sizes(text: str) -> list[tuple[int, int]]:
    """``"1328x1328,1664x928"`` -> [(1328, 1328), (1664, 928)] (width x height, multiples of 16)."""
    out = []
    for item in text.split(","):
        w, _, h = item.strip().lower().partition("x")
        if not (w.isdigit() and h.isdigit()) or int(w) % 16 or int(h) % 16 or not int(w) or not int(h):
            raise ValueError(f"size {item!r}: WIDTHxHEIGHT, both positive multiples of 16 (e.g. 1328x1328)")
        out.append((int(w), int(h)))
    return out


def parse_ints(text: str, what: str) -> list[int]:
    """``"1,2"`` -> [1, 2]: a comma list of positive integers; ``what`` names the option in the error."""
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise ValueError(f"{what} {text!r}: a comma list of positive integers")
    return vals


def _freqs(s: int, d: int, device: torch.device, g: torch.Generator) -> torch.Tensor:
    theta = torch.rand(s, d // 2, generator=g, dtype=torch.float64) * 6.283
    return torch.polar(torch.ones_like(theta), theta).to(torch.complex64).to(device)


def warm(
    sizes: list[tuple[int, int]],
    batches: list[int],
    sp: int = 1,
    texts: tuple[int, ...] | list[int] = DEFAULT_TEXT,
    *,
    heads: int = 24,
    head_dim: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | None = None,
) -> list[Row]:
    """Check every class of the module docstring (each once); returns one row per class asked."""
    if heads % sp:
        raise ValueError(f"--sp {sp} must divide the {heads} heads (Ulysses splits heads)")
    dev = device if device is not None else _backend.npu_device()
    rope, qk, fa = (registry.get(n) for n in ("rope", "qk_norm", "fused_attention"))
    g = torch.Generator().manual_seed(0x3A3)
    rows: list[Row] = []
    done: set[Any] = set()

    def run(kernel: str, label: str, key: Any, fn: Any) -> None:
        if key in done:
            return
        done.add(key)
        t0 = time.perf_counter()
        outcome = {True: VERIFIED, False: REFUSED, None: UNVERIFIED}[fn()]
        v = {"rope": rope.rotary, "qk": qk.path, "fa": fa.path}[key[0]].classes.get(key[1:])
        rows.append(Row(kernel, label, outcome, time.perf_counter() - t0, v.timing if v is not None else None))

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=dev, dtype=dtype)

    weight = torch.ones(head_dim, device=dev, dtype=dtype)
    with torch.no_grad():
        for (w, h), b, t in itertools.product(sizes, batches, texts):
            img = (w // 16) * (h // 16)
            joint = img + t
            for name, s in (("image", -(-img // sp)), ("text", t), ("joint", -(-joint // sp))):
                x, label = rnd(b, s, heads, head_dim), f"{name} B={b} S={s}"
                key = ("rope", *rotary.shape_class(x))
                run("npu_rotary_mul", label, key, lambda x=x, s=s: rope.rotary.warm(x, _freqs(s, head_dim, dev, g)))
                if name != "joint":
                    key = ("qk", *rms_norm.shape_class(x))
                    run("npu_rms_norm", label, key, lambda x=x: qk.path.warm(x, weight, 1e-6))
            for m in (False, True) if b > 1 else (False,):
                q = rnd(b, joint, heads // sp, head_dim)
                masked = None
                if m:
                    keep = torch.ones(b, joint, dtype=torch.bool, device=dev)
                    keep[1:, max(0, t - 8) : t] = False  # a shorter second prompt
                    masked = (~keep).view(b, 1, 1, joint).expand(b, 1, joint, joint).contiguous()
                key = ("fa", *npu_attention.shape_class(q, q, masked))
                label = f"joint B={b} S={joint} heads={heads // sp}{' masked' if m else ''}"
                run("npu_fusion_attention", label, key, lambda q=q, masked=masked: fa.warm(q, q, q, masked))
                del q, masked
    return rows


def summary(rows: list[Row]) -> str:
    n = {o: sum(r.outcome == o for r in rows) for o in (VERIFIED, REFUSED, UNVERIFIED)}
    total = sum(r.seconds for r in rows)
    where = saved.path()
    return (
        f"{len(rows)} shape classes: {n[VERIFIED]} verified, {n[REFUSED]} refused, {n[UNVERIFIED]} not decided; {total:.1f} s of checks; verdicts saved in "
        f"{where if where is not None else 'nowhere (' + saved.ENV_VERDICT_CACHE + ' disables the cache)'}"
    )
