"""Seeded PEFT LoRA adapters written the way vLLM-Omni's ``DiffusionLoRAManager`` loads them, for the tests that
switch adapters between requests (a switch changes the targeted linears: every cache keyed on them must miss).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

#: The modulation projections: what a switch must invalidate in ``shared_modulation``'s memo.
MODULATION_TARGETS = ("img_mod.1", "txt_mod.1")


def write_adapter(
    path: str | Path,
    transformer: Any,
    *,
    targets: tuple[str, ...] = MODULATION_TARGETS,
    rank: int = 4,
    seed: int = 0,
    std: float = 0.1,
) -> Path:
    """A PEFT LoRA adapter for every ``transformer_blocks.<i>.<target>`` linear of ``transformer`` (vLLM linears:
    ``input_size`` / ``output_size``), with N(0, ``std``) A and B matrices drawn from ``seed``."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i, block in enumerate(transformer.transformer_blocks):
        for target in targets:
            lin = block.get_submodule(target)
            base = getattr(lin, "base_layer", lin)  # already wrapped by a LoRA manager
            name = f"base_model.model.transformer_blocks.{i}.{target}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, base.input_size, generator=g) * std
            tensors[f"{name}.lora_B.weight"] = torch.randn(base.output_size, rank, generator=g) * std
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(targets), "bias": "none"}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return out
