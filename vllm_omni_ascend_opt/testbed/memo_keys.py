"""A storage-independent weight signature for the modulation memo, standing in for issue 21's re-key in the tests and
the benchmark of ``memo_aware_offload`` (``benchmarks/bench_offload.py --rekey``) until it lands. Test bed only:
nothing in the plugin imports it.

vLLM-Omni's layerwise offload gives every block weight fresh device storage on every forward (and a zero-element
placeholder between forwards). The memo's signature on this base (``blocks/modulation_keys.linear_sig``) includes
``data_ptr`` and shape, so it cannot hit for an offloaded block and ``memo_aware_offload`` then copies everything
(exact, no gain). Issue 21 keys on the parameters' identity and version plus a weights generation; this stand-in keys
on identity, version, dtype and device (what a placeholder keeps), after the same ``Unkeyable`` checks. It is exact
in these tests: nothing writes the weights behind their version counters while they run. Harmless after the re-key
(it then replaces one storage-independent signature by another).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn


def storage_independent_sig(real: Any) -> Any:
    def linear_sig(lin: nn.Module, grad: bool) -> tuple[Any, ...]:
        real(lin, grad)  # the same refusals (Unkeyable) as the real signature
        d = lin.__dict__
        if lin._modules or lin._buffers or "lora_a_stacked" in d:
            tensors = [*lin.parameters(), *lin.buffers()]
            for name in ("lora_a_stacked", "lora_b_stacked"):
                tensors.extend(t for t in d.get(name, ()) if isinstance(t, torch.Tensor))
            quant = getattr(lin, "quant_method", None)
        else:
            tensors = [t for t in lin._parameters.values() if t is not None]
            quant = d.get("quant_method")
        sig: list[Any] = [id(lin), id(quant), d.get("_diffusion_lora_active_slices")]
        with torch._C.DisableTorchFunctionSubclass():
            sig += [(id(t), t._version, t.dtype, t.device) for t in tensors]
        return tuple(sig)

    return linear_sig


@contextlib.contextmanager
def storage_independent_keys() -> Iterator[None]:
    """While active, the memo signs weights by identity, version, dtype and device (see the module docstring)."""
    from vllm_omni_ascend_opt.blocks import modulation_keys, modulation_memo

    real = modulation_keys.linear_sig
    sig = storage_independent_sig(real)
    modulation_keys.linear_sig = sig
    had = "linear_sig" in vars(modulation_memo)
    modulation_memo.linear_sig = sig
    try:
        yield
    finally:
        modulation_keys.linear_sig = real
        if had:
            modulation_memo.linear_sig = real
