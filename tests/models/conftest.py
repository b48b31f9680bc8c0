"""Tiny random transformers Qwen3-Next and Qwen3.5 checkpoints, saved once per test session."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from qwen35_reference import make_qwen35, save_qwen35
from tiny import make_hf_model, save_checkpoint
from transformers import Qwen3NextForCausalLM

# The reference must be transformers' pure-PyTorch path, not flash-linear-attention's kernels.
assert importlib.util.find_spec("fla") is None, "uninstall flash-linear-attention: it replaces the reference"

Checkpoint = tuple[Qwen3NextForCausalLM, Path]


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Checkpoint]:
    """make_checkpoint(name, dtype=float32, **config overrides) -> (transformers model, checkpoint dir).

    Cached by name: tests asking for the same name share one model (don't modify it).
    """
    cache: dict[str, Checkpoint] = {}

    def make(name: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides: object) -> Checkpoint:
        if name not in cache:
            model = make_hf_model(seed, **overrides)
            path = save_checkpoint(model, tmp_path_factory.mktemp(name), dtype)
            cache[name] = (model, path)
        return cache[name]

    return make


@pytest.fixture(scope="session")
def tiny_checkpoint(make_checkpoint: Callable[..., Checkpoint]) -> Checkpoint:
    """The default tiny model: 3 linear + 1 attention layer, Hv = 2·Hk, 4 experts top-2, untied."""
    return make_checkpoint("default")


@pytest.fixture(scope="session")
def make_qwen35_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[Any, Path]]:
    """make_qwen35_checkpoint(name, save={...}, **make_qwen35 arguments) -> (transformers model, dir).

    `save` goes to `save_qwen35` (dtype, shards, mtp, per_expert). Cached by name, like make_checkpoint.
    """
    cache: dict[str, tuple[Any, Path]] = {}

    def make(name: str, save: dict[str, Any] | None = None, **model: Any) -> tuple[Any, Path]:
        if name not in cache:
            hf = make_qwen35(**model)
            cache[name] = (hf, save_qwen35(hf, tmp_path_factory.mktemp(name), **(save or {})))
        return cache[name]

    return make
