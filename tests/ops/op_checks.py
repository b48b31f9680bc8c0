"""What every op test needs: a relative closeness check against the naive twin, varlen offsets,
a thread count for a block."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-5, dtype: torch.dtype | None = torch.float32
) -> None:
    """max |actual - expected| <= rel * max(1, max |expected|); `actual` has `dtype` unless None."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if dtype is not None:
        assert actual.dtype == dtype, actual.dtype
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    diff = (actual.float() - expected.float()).abs().max().item() if expected.numel() else 0.0
    assert diff <= rel * scale, f"max abs diff {diff:.3g} > {rel:g} * {scale:.3g}"


def cu_seqlens_of(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lens]).cumsum(0)


@contextlib.contextmanager
def threads(n: int | None) -> Iterator[None]:
    """torch's thread count n (None: as it is) within the block, then back."""
    before = torch.get_num_threads()
    torch.set_num_threads(n or before)
    try:
        yield
    finally:
        torch.set_num_threads(before)
