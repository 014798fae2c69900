"""Fake torch_npu kernels: rotary. Each documented constraint is checked with its source cited (see __init__)."""

from __future__ import annotations

from typing import Any

#: kernel name -> {variant: implementation}; "correct" follows the documentation.
VARIANTS: dict[str, dict[str, Any]] = {}
