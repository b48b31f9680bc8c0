"""Dtype helpers for the hot paths."""

from __future__ import annotations

import torch


def f32(x: torch.Tensor) -> torch.Tensor:
    """`x` as float32; `x` itself when it already is (a decode step makes hundreds of these calls,
    and even a no-op `.float()` goes through the dispatcher)."""
    return x if x.dtype == torch.float32 else x.float()
