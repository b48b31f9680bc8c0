"""The model families, found by the `family` their config.json's `model_type` names, and loading.

A family is one file in `models/` (its model class and its checkpoint mapping) plus one entry
here; nothing outside `models/` names a family.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridkv.models import qwen3_5, qwen3_next
from hybridkv.models.config import ModelConfig
from hybridkv.models.gguf_checkpoint import GGUFCheckpoint, GGUFTensors
from hybridkv.models.qwen3_next import Qwen3NextModel
from hybridkv.models.weights import Checkpoint, Layout, TensorSource, load_weights


def _as_is(config: ModelConfig, names: set[str]) -> ModelConfig:
    return config


@dataclass(frozen=True, slots=True)
class Family:
    """What loading needs to know about a family.

    `for_checkpoint(config, names)`: the config adjusted to what the files hold (Qwen3.5 ties the
    head exactly when `lm_head.weight` is absent). `checkpoint_layout(config, names)`: our
    parameters from checkpoint tensors. `is_ignored(config, name)`: checkpoint tensors neither
    loaded nor counted in the memory check.
    """

    model_class: type[Qwen3NextModel]
    checkpoint_layout: Callable[[ModelConfig, set[str]], Layout]
    is_ignored: Callable[[ModelConfig, str], bool]
    for_checkpoint: Callable[[ModelConfig, set[str]], ModelConfig] = _as_is


FAMILIES: dict[str, Family] = {
    "qwen3_next": Family(Qwen3NextModel, qwen3_next.checkpoint_layout, qwen3_next.is_ignored),
    "qwen3_5": Family(qwen3_5.Qwen3_5Model, qwen3_5.checkpoint_layout, qwen3_5.is_ignored, qwen3_5.for_checkpoint),
}


def read_checkpoint(model_dir: str | Path) -> tuple[ModelConfig, TensorSource]:
    """The config (as the files have it) and the tensors of a checkpoint directory, or of a GGUF
    file (the first of a split set), seen as the Hugging Face checkpoint it was converted from."""
    checkpoint: TensorSource
    if Path(model_dir).is_file():
        checkpoint = GGUFCheckpoint(GGUFTensors(model_dir))
        config = ModelConfig.from_dict(checkpoint.hf_config, source=str(model_dir))
    else:
        config = ModelConfig.from_dir(model_dir)
        checkpoint = Checkpoint(model_dir)
    return FAMILIES[config.family].for_checkpoint(config, checkpoint.names), checkpoint


def weights_nbytes(model_dir: str | Path, dtype: torch.dtype) -> int:
    """Bytes the weights a model loads from `model_dir` (a directory or a GGUF file) occupy once
    cast to `dtype`."""
    config, checkpoint = read_checkpoint(model_dir)
    family = FAMILIES[config.family]
    itemsize = torch.empty((), dtype=dtype).element_size()
    return sum(checkpoint.numel(name) * itemsize for name in checkpoint.names if not family.is_ignored(config, name))


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> Qwen3NextModel:
    """Build the model of a Hugging Face checkpoint directory or a GGUF file, weights cast to `dtype`."""
    config, checkpoint = read_checkpoint(model_dir)
    family = FAMILIES[config.family]
    model = family.model_class(config, dtype)
    layout = family.checkpoint_layout(config, checkpoint.names)
    load_weights(dict(model.named_parameters()), layout, checkpoint, lambda name: family.is_ignored(config, name))
    return model.eval()
