"""Seeded PEFT LoRA adapters, written as vLLM-Omni's ``DiffusionLoRAManager`` loads them, for tests that switch
adapters between requests (a switch changes the targeted linears: every cache keyed on them must miss)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

#: The modulation projections: what a switch must invalidate in ``shared_modulation``'s memo.
TARGETS = ("img_mod.1", "txt_mod.1")
RANK = 4


def write_adapter(path: str | Path, transformer: Any, *, seed: int = 0) -> Path:
    """A rank-4 adapter on every block's ``TARGETS`` linear (vLLM linears), A and B drawn N(0, 0.1) from ``seed``."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i, block in enumerate(transformer.transformer_blocks):
        for target in TARGETS:
            lin = block.get_submodule(target)
            base = getattr(lin, "base_layer", lin)  # already wrapped by a LoRA manager
            name = f"base_model.model.transformer_blocks.{i}.{target}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(RANK, base.input_size, generator=g) * 0.1
            tensors[f"{name}.lora_B.weight"] = torch.randn(base.output_size, RANK, generator=g) * 0.1
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": RANK, "lora_alpha": RANK, "target_modules": list(TARGETS), "bias": "none"}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return out
