"""Writing GGUF files: the container `models.gguf` reads (header, typed metadata, tensor infos,
aligned data), nothing about models.

Tensors are described before any is computed — name, torch shape, ggml type and a function that
produces the bytes — so the header (which holds every offset) is written first and the data
streams after it, one tensor in memory at a time. The file appears under its name only once
complete (written beside it, then renamed).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from hybridkv.models.gguf import DEFAULT_ALIGNMENT, GGML_TYPES, GGUF_MAGIC

VERSION = 3
# GGUF metadata value types (gguf.GGUFValueType)
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_FORMATS = {UINT8: "<B", INT8: "<b", UINT16: "<H", INT16: "<h", UINT32: "<I", INT32: "<i", FLOAT32: "<f"}
_FORMATS |= {BOOL: "<?", UINT64: "<Q", INT64: "<q", FLOAT64: "<d"}


@dataclass(frozen=True, slots=True)
class Value:
    """One metadata value with its GGUF type; `element` is an array's element type."""

    type: int
    value: Any
    element: int | None = None


def u32(v: int) -> Value:
    return Value(UINT32, int(v))


def f32(v: float) -> Value:
    return Value(FLOAT32, float(v))


def string(v: str) -> Value:
    return Value(STRING, v)


def boolean(v: bool) -> Value:
    return Value(BOOL, bool(v))


def array(element: int, values: Iterable[Any]) -> Value:
    return Value(ARRAY, list(values), element)


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """A tensor to write: `shape` in torch order (slowest first), `type_id` a ggml type, and
    `produce()` its data — uint8 block rows for block types, else an array of the type's dtype
    (BF16 as its uint16 bits), `n_bytes` long."""

    name: str
    shape: tuple[int, ...]
    type_id: int
    produce: Callable[[], torch.Tensor | np.ndarray]

    @property
    def n_bytes(self) -> int:
        t = GGML_TYPES[self.type_id]
        n = int(np.prod(self.shape)) if self.shape else 1
        if self.shape and self.shape[-1] % t.block_size:
            raise ValueError(f"tensor {self.name!r}: rows of {self.shape[-1]} do not split into {t.name} blocks")
        return t.row_bytes(n)


def _write_string(out: BinaryIO, text: str) -> None:
    raw = text.encode()
    out.write(struct.pack("<Q", len(raw)))
    out.write(raw)


def _write_value(out: BinaryIO, value: Value, key: str) -> None:
    if value.type == STRING:
        _write_string(out, value.value)
    elif value.type == ARRAY:
        if value.element is None or value.element == ARRAY:
            raise ValueError(f"metadata {key!r}: an array needs a scalar or string element type")
        out.write(struct.pack("<IQ", value.element, len(value.value)))
        if value.element == STRING:
            for item in value.value:
                _write_string(out, item)
        else:
            out.write(np.asarray(value.value, dtype=np.dtype(_FORMATS[value.element])).tobytes())
    else:
        out.write(struct.pack(_FORMATS[value.type], value.value))


def _pad(out: BinaryIO, alignment: int) -> None:
    out.write(b"\0" * (-out.tell() % alignment))


def _as_bytes(data: torch.Tensor | np.ndarray) -> bytes:
    array = data.contiguous().numpy() if isinstance(data, torch.Tensor) else np.ascontiguousarray(data)
    return array.tobytes()


def write_gguf(
    path: str | Path, metadata: Mapping[str, Value], tensors: list[TensorEntry], alignment: int = DEFAULT_ALIGNMENT
) -> None:
    """Write a GGUF v3 file: `metadata` in order, then `tensors` in order, each aligned."""
    path = Path(path)
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: duplicate tensor names")
    partial = path.with_name(path.name + ".partial")
    try:
        with open(partial, "wb") as out:
            out.write(GGUF_MAGIC)
            out.write(struct.pack("<IQQ", VERSION, len(tensors), len(metadata)))
            for key, value in metadata.items():
                _write_string(out, key)
                out.write(struct.pack("<I", value.type))
                _write_value(out, value, key)
            offset = 0
            for t in tensors:
                _write_string(out, t.name)
                ne = tuple(reversed(t.shape))
                out.write(struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, t.type_id, offset))
                offset += t.n_bytes + -t.n_bytes % alignment
            _pad(out, alignment)
            for t in tensors:
                data = _as_bytes(t.produce())
                if len(data) != t.n_bytes:
                    raise ValueError(f"tensor {t.name!r}: produced {len(data)} bytes, its header says {t.n_bytes}")
                out.write(data)
                _pad(out, alignment)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
