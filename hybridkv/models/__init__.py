"""Model definitions, config parsing and weight loading; pure functions of tokens and a forward batch."""

from hybridkv.models.config import ModelConfig
from hybridkv.models.qwen3_5 import Qwen3_5Model
from hybridkv.models.qwen3_next import Qwen3NextModel
from hybridkv.models.registry import FAMILIES, load_model, read_checkpoint, weights_nbytes
from hybridkv.models.weights import (
    InsufficientMemory,
    MemoryShare,
    MissingWeightsFile,
    WeightsError,
    check_memory_fit,
)

__all__ = [
    "FAMILIES",
    "InsufficientMemory",
    "MemoryShare",
    "MissingWeightsFile",
    "ModelConfig",
    "Qwen3NextModel",
    "Qwen3_5Model",
    "WeightsError",
    "check_memory_fit",
    "load_model",
    "read_checkpoint",
    "weights_nbytes",
]
