"""Model definitions, config parsing and weight loading; pure functions of tokens and a forward batch."""

from hybridkv.models.config import ModelConfig
from hybridkv.models.qwen3_next import Qwen3NextModel, load_model
from hybridkv.models.weights import (
    InsufficientMemory,
    MissingWeightsFile,
    WeightsError,
    check_memory_fit,
    checkpoint_nbytes,
)

__all__ = [
    "InsufficientMemory",
    "MissingWeightsFile",
    "ModelConfig",
    "Qwen3NextModel",
    "WeightsError",
    "check_memory_fit",
    "checkpoint_nbytes",
    "load_model",
]
