"""GGUF weight block types as tensors: the traits table, bit-exact dequantizers, quantized matmuls."""

from hybridkv.ops.quant.traits import TRAITS, BlockType, GGMLType, UnsupportedTypeError, block_type, dequantize
from hybridkv.ops.quant.weight import QuantizedWeight

__all__ = ["TRAITS", "BlockType", "GGMLType", "QuantizedWeight", "UnsupportedTypeError", "block_type", "dequantize"]
