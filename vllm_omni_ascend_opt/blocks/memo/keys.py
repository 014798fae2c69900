"""What the modulation memo keys on: weight signatures (:func:`linear_sig`), numerical settings, AdaLayerNorm kinds,
the span of a digested ``temb`` (:class:`Span`), and when a projection cannot be keyed (:class:`Unkeyable`, the very
checks :func:`unkeyable_reasons` reports for a model)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from vllm_omni_ascend_opt.blocks.upstream import ada_norm, guards, targets

SELECT01_MODULE = "vllm_omni.diffusion.layers.qwen_select01_modulation"


class Unkeyable(Exception):
    """This call cannot be memoized safely; the message says why (reported as a fallback reason)."""


def numerical_settings(device_type: str) -> tuple[Any, ...]:
    """Process state that can change what the projection computes for the same inputs and weights."""
    mm = torch.backends.cuda.matmul
    return (
        torch.is_grad_enabled(),  # vLLM-Omni's LoRA apply() takes a different (out=) path without grad
        torch.get_float32_matmul_precision(),
        torch.is_autocast_enabled(device_type),
        torch.get_autocast_dtype(device_type),
        (mm.allow_tf32, mm.allow_bf16_reduced_precision_reduction, mm.allow_fp16_reduced_precision_reduction),
        getattr(getattr(getattr(torch, "npu", None), "matmul", None), "allow_hf32", None),
    )


@dataclass(frozen=True, slots=True)
class Span:
    """The memory a digested contiguous temb covered; holds its storage so the address cannot be reused."""

    storage: Any
    dtype: torch.dtype
    offset: int
    numel: int

    @staticmethod
    def of(t: torch.Tensor) -> Span | None:
        return Span(t.untyped_storage(), t.dtype, t.storage_offset(), t.numel()) if t.is_contiguous() else None

    def contains(self, a: torch.Tensor) -> bool:
        """``a`` reads only this span's memory (same storage, dtype): the digest and its geometry fix its values."""
        if a.dtype != self.dtype or a.untyped_storage().data_ptr() != self.storage.data_ptr():
            return False
        if a.numel() == 0 or any(st < 0 for st in a.stride()):
            return False
        last = a.storage_offset() + sum((n - 1) * st for n, st in zip(a.shape, a.stride(), strict=True))
        return self.offset <= a.storage_offset() and last < self.offset + self.numel


def sig_tensors(lin: nn.Module) -> list[torch.Tensor]:
    """The tensors a linear's :func:`linear_sig` covers, in its order: parameters, buffers and vLLM LoRA stacks."""
    if not (lin._modules or lin._buffers or "lora_a_stacked" in lin.__dict__):  # a plain layer: its own parameters
        return [t for t in lin._parameters.values() if t is not None]
    tensors = [*lin.parameters(), *lin.buffers()]
    for name in ("lora_a_stacked", "lora_b_stacked"):
        tensors.extend(t for t in lin.__dict__.get(name, ()) if isinstance(t, torch.Tensor))
    return tensors


def tensor_state(tensors: tuple[torch.Tensor, ...] | list[torch.Tensor], grad: bool) -> tuple[Any, ...]:
    """Each tensor's (identity, version counter, dtype, device); :class:`Unkeyable` while autograd records through one
    of them, or without a version counter."""
    if grad and any(t.requires_grad for t in tensors):
        raise Unkeyable("autograd is recording (grad enabled and a modulation weight requires grad)")
    sig = []
    with torch._C.DisableTorchFunctionSubclass():  # metadata reads: vLLM's parameter subclasses need no dispatch
        for t in tensors:
            try:
                sig.append((id(t), t._version, t.dtype, t.device))
            except RuntimeError as exc:
                if t.is_inference():
                    raise Unkeyable(
                        "modulation weights are inference tensors (no version counter to detect in-place "
                        "updates); load or cast them under torch.no_grad(), not torch.inference_mode()"
                    ) from None
                raise Unkeyable(f"cannot read a modulation weight's version ({type(t).__name__}: {exc})") from None
    return tuple(sig)


def linear_sig(lin: nn.Module, grad: bool) -> tuple[Any, ...]:
    """What a vLLM ReplicatedLinear's output depends on besides its input (:class:`Unkeyable` for other layers): the
    ids of the layer and its quant method, its LoRA slices and :func:`tensor_state` of :func:`sig_tensors`. Neither
    storage nor shape: layerwise offload swaps storage and leaves ``(0,)`` placeholders between forwards."""
    cls = type(lin)
    if not issubclass(cls, sys.modules[targets.TRANSFORMER].ReplicatedLinear) and not any(
        c.__name__ == "ReplicatedLinearWithLoRA" for c in cls.__mro__
    ):
        raise Unkeyable(f"modulation projection is a {cls.__name__}, not a ReplicatedLinear")
    d = lin.__dict__
    static = (id(lin), id(getattr(lin, "quant_method", None)), d.get("_diffusion_lora_active_slices"))
    return static + tensor_state(sig_tensors(lin), grad)


def norm_out_sig(norm: nn.Module, grad: bool) -> tuple[Any, ...]:
    """The weight signature of ``norm_out``'s linear; :class:`Unkeyable` unless its SiLU and linear are stock's."""
    silu, lin = norm._modules.get("silu"), norm._modules.get("linear")
    if type(silu) is not nn.SiLU or silu.inplace or guards.hooked(silu) or guards.hooked(lin):
        raise Unkeyable("norm_out's SiLU/linear is not stock's (or has hooks)")
    return linear_sig(lin, grad)


def silu_linear(seq: nn.Module) -> nn.Module:
    """The linear of stock's ``nn.Sequential(nn.SiLU(), <linear>)``; :class:`Unkeyable` if ``seq`` is not that."""
    mods = seq._modules
    if not isinstance(seq, nn.Sequential) or len(mods) != 2:
        raise Unkeyable("modulation module is not nn.Sequential(SiLU, Linear)")
    act, lin = mods.values()
    if type(act) is not nn.SiLU or act.inplace:
        raise Unkeyable("modulation activation is not an out-of-place nn.SiLU")
    if guards.hooked(seq) or _hooked_tree(act) or _hooked_tree(lin):
        raise Unkeyable("forward hooks on a modulation module (skipping it would skip the hook)")
    return lin


def _hooked_tree(m: nn.Module) -> bool:
    """``m`` or a module below it carries forward hooks (a leaf is checked without walking)."""
    if m._forward_hooks or m._forward_pre_hooks:  # guards.hooked(m), inlined: four calls per block
        return True
    return bool(m._modules) and any(guards.hooked(c) for c in m.modules())


def block_parts(
    block: nn.Module, grad: bool | None = None
) -> tuple[nn.Module, nn.Module, tuple[str, ...], tuple, tuple]:
    """(img linear, txt linear, the four AdaLayerNorm kinds, img and txt weight signatures): a block's memo key."""
    grad = torch.is_grad_enabled() if grad is None else grad
    m = block._modules
    img_lin = silu_linear(m["img_mod"])
    txt_lin = silu_linear(m["txt_mod"])
    kinds = ada_norm.norm_kinds(m["img_norm1"], m["img_norm2"], m["txt_norm1"], m["txt_norm2"])
    return img_lin, txt_lin, kinds, linear_sig(img_lin, grad), linear_sig(txt_lin, grad)


def modulation_linears(transformer: nn.Module) -> list[nn.Module]:
    """Every projection whose output depends only on temb: each block's img_mod/txt_mod linear and norm_out.linear."""
    out = [seq._modules["1"] for b in transformer.transformer_blocks for seq in (b.img_mod, b.txt_mod)]
    out.append(transformer.norm_out.linear)
    return out


def unkeyable_reasons(transformer: nn.Module) -> list[str]:
    """Why the memo cannot key some of ``transformer``'s projections (the per-call checks, made on the model)."""
    reasons = []
    checks = [(block_parts, b) for b in transformer.transformer_blocks] + [(norm_out_sig, transformer.norm_out)]
    for check, module in checks:
        try:
            check(module, grad=False)
        except Unkeyable as exc:
            reasons.append(str(exc))
    return list(dict.fromkeys(reasons))
