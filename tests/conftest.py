from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

# `hybridkv run` and `serve` keep a disk cache under ~/.cache by default: the tests (and the
# commands they start) run without one unless a test asks.
os.environ["HYBRIDKV_CACHE_DISK"] = "0"


@pytest.fixture(autouse=True)
def _keep_torch_threads() -> Iterator[None]:
    """The CLI run in-process sets torch's thread count (to the cores other processes leave idle):
    each test starts with the count the run started with."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
