"""Reading GGUF files (llama.cpp's format): metadata, tensor directory, and zero-copy views of tensor data.

A GGUF file is, in order (all little-endian):

    magic "GGUF" | u32 version (2 or 3) | u64 tensor_count | u64 kv_count
    kv_count x   (string key, u32 value type, value)        strings: u64 length + UTF-8 bytes
    tensor_count x (string name, u32 n_dims, u64 ne[n_dims], u32 ggml type, u64 offset)
    padding to `general.alignment` (default 32)
    data: each tensor at data start + its offset (a multiple of the alignment)

`ne` runs fastest dimension first, so the torch shape is `reversed(ne)`; quantized blocks run along
`ne[0]`, so each row of a block tensor is a self-contained run of `row_bytes` bytes.

gguf-py's `GGUFReader` decodes every array element in Python (~13 s for a 152k-token vocabulary);
this reader decodes numeric arrays with NumPy and string arrays in one tight loop (a few tenths of
a second for that vocabulary and its merges), and maps the file instead of reading it. Split files
(`NAME-00001-of-0000N.gguf`, written by llama.cpp's gguf-split) open as one model: metadata from
the first part, tensors from all parts.
"""

from __future__ import annotations

import contextlib
import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp rejects tensors with more
SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class GGUFError(ValueError):
    """A GGUF file is malformed or inconsistent: the message names the file and what is wrong."""


class MissingGGUFFile(GGUFError, FileNotFoundError):
    """A GGUF file, or some parts of a split GGUF, do not exist: the message lists them."""


@dataclass(frozen=True, slots=True)
class GGMLType:
    """One ggml tensor type: `block_size` elements take `type_size` bytes.

    `dtype` is the NumPy element type of unblocked types (BF16 as raw uint16) and None for block
    types, whose data is viewed as bytes.
    """

    id: int
    name: str
    block_size: int
    type_size: int
    dtype: np.dtype[Any] | None = None

    def row_bytes(self, n: int) -> int:
        """Bytes of a row of `n` elements (`n` a multiple of `block_size`)."""
        return n // self.block_size * self.type_size


def _types(*rows: tuple[Any, ...]) -> dict[int, GGMLType]:
    return {r[0]: GGMLType(r[0], r[1], r[2], r[3], np.dtype(r[4]) if len(r) == 5 else None) for r in rows}


# ggml.h `enum ggml_type` and ggml.c `type_traits` (block sizes as in gguf-py's GGML_QUANT_SIZES);
# ids 4, 5 and 31-33, 36-38 are retired and cannot appear in a GGUF file.
GGML_TYPES: dict[int, GGMLType] = _types(
    (0, "F32", 1, 4, "<f4"),
    (1, "F16", 1, 2, "<f2"),
    (2, "Q4_0", 32, 18),
    (3, "Q4_1", 32, 20),
    (6, "Q5_0", 32, 22),
    (7, "Q5_1", 32, 24),
    (8, "Q8_0", 32, 34),
    (9, "Q8_1", 32, 40),
    (10, "Q2_K", 256, 84),
    (11, "Q3_K", 256, 110),
    (12, "Q4_K", 256, 144),
    (13, "Q5_K", 256, 176),
    (14, "Q6_K", 256, 210),
    (15, "Q8_K", 256, 292),
    (16, "IQ2_XXS", 256, 66),
    (17, "IQ2_XS", 256, 74),
    (18, "IQ3_XXS", 256, 98),
    (19, "IQ1_S", 256, 50),
    (20, "IQ4_NL", 32, 18),
    (21, "IQ3_S", 256, 110),
    (22, "IQ2_S", 256, 82),
    (23, "IQ4_XS", 256, 136),
    (24, "I8", 1, 1, "<i1"),
    (25, "I16", 1, 2, "<i2"),
    (26, "I32", 1, 4, "<i4"),
    (27, "I64", 1, 8, "<i8"),
    (28, "F64", 1, 8, "<f8"),
    (29, "IQ1_M", 256, 56),
    (30, "BF16", 1, 2, "<u2"),
    (34, "TQ1_0", 256, 54),
    (35, "TQ2_0", 256, 66),
    (39, "MXFP4", 32, 17),
    (40, "NVFP4", 64, 36),
    (41, "Q1_0", 128, 18),
    (42, "Q2_0", 64, 18),
)
GGML_TYPE_IDS: dict[str, int] = {t.name: t.id for t in GGML_TYPES.values()}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where one tensor lies: `shape` in torch order (slowest dimension first), `n_bytes` at
    absolute byte `offset` of file `path`."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLType
    n_bytes: int
    offset: int
    path: Path

    @property
    def type_id(self) -> int:
        return self.ggml_type.id

    @property
    def type_name(self) -> str:
        return self.ggml_type.name

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


# GGUF metadata value types: id -> (name, struct format). 8 is string, 9 is array.
_STRING, _ARRAY, _BOOL = 8, 9, 7
_SCALARS: dict[int, tuple[str, struct.Struct]] = {
    i: (name, struct.Struct(fmt))
    for i, name, fmt in [
        (0, "uint8", "<B"),
        (1, "int8", "<b"),
        (2, "uint16", "<H"),
        (3, "int16", "<h"),
        (4, "uint32", "<I"),
        (5, "int32", "<i"),
        (6, "float32", "<f"),
        (7, "bool", "<?"),
        (10, "uint64", "<Q"),
        (11, "int64", "<q"),
        (12, "float64", "<d"),
    ]
}
_U32, _U64 = _SCALARS[4][1], _SCALARS[10][1]


class _Cursor:
    """Reads GGUF header fields from a buffer, checking every read against the end of the file."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.path, self.pos, self.end = buf, path, 0, len(buf)

    def error(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path}: {what}")

    def need(self, n: int, what: str) -> None:
        if self.pos + n > self.end:
            raise self.error(f"truncated: {what} at byte {self.pos} needs {n} bytes, the file has {self.end}")

    def scalar(self, st: struct.Struct, what: str) -> Any:
        self.need(st.size, what)
        (value,) = st.unpack_from(self.buf, self.pos)
        self.pos += st.size
        return value

    def string(self, what: str) -> str:
        n = self.scalar(_U64, what)
        self.need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode()
        except UnicodeDecodeError as e:
            raise self.error(f"{what} is not valid UTF-8 ({e.reason} at byte {e.start})") from None

    def value(self, vtype: int, key: str) -> Any:
        if vtype == _STRING:
            return self.string(f"value of {key!r}")
        if vtype == _ARRAY:
            return self.array(key)
        if vtype not in _SCALARS:
            raise self.error(f"metadata {key!r} has unknown value type {vtype}")
        return self.scalar(_SCALARS[vtype][1], f"value of {key!r}")

    def array(self, key: str) -> list[Any]:
        what = f"array {key!r}"
        etype = self.scalar(_U32, f"element type of {what}")
        count = self.scalar(_U64, f"length of {what}")
        if etype == _STRING:
            self.need(8 * count, f"{count} strings of {what}")
            return self.strings(count, what)
        if etype == _ARRAY:
            raise self.error(f"{what} holds arrays; nested arrays are not valid GGUF (llama.cpp rejects them too)")
        if etype not in _SCALARS:
            raise self.error(f"{what} has unknown element type {etype}")
        st = _SCALARS[etype][1]
        self.need(st.size * count, f"{count} elements of {what}")
        dtype = np.dtype("<u1") if etype == _BOOL else np.dtype(st.format)
        values = np.frombuffer(self.buf, dtype, count, self.pos)
        self.pos += st.size * count
        return (values != 0).tolist() if etype == _BOOL else values.tolist()

    def strings(self, count: int, what: str) -> list[str]:
        """`count` length-prefixed UTF-8 strings: the hot loop for vocabularies and merges."""
        buf, pos, end, unpack = self.buf, self.pos, self.end, _U64.unpack_from
        out: list[str] = []
        append = out.append
        try:
            for _ in range(count):
                (n,) = unpack(buf, pos)
                pos += 8
                stop = pos + n
                if stop > end:
                    break
                append(buf[pos:stop].decode())
                pos = stop
            else:
                self.pos = pos
                return out
        except struct.error:
            pass  # a length prefix past the end: reported as truncation below
        except UnicodeDecodeError as e:
            raise self.error(f"string {len(out)} of {what} is not valid UTF-8 ({e.reason} at byte {e.start})") from None
        self.pos = pos
        raise self.error(f"truncated: string {len(out)} of {what} runs past the end of the file ({end} bytes)")


@dataclass(frozen=True, slots=True)
class _Part:
    """One parsed GGUF file (a whole model, or one part of a split one)."""

    path: Path
    buf: mmap.mmap
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    alignment: int


def _read_part(path: Path) -> _Part:
    if not path.is_file():
        raise MissingGGUFFile(f"{path}: no such GGUF file")
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise GGUFError(f"{path}: truncated: {size} bytes, a GGUF header needs at least 24")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _parse(path, buf)
    except BaseException:
        buf.close()
        raise


def _parse(path: Path, buf: mmap.mmap) -> _Part:
    cur = _Cursor(buf, path)
    if buf[:4] != GGUF_MAGIC:
        raise cur.error(f"not a GGUF file: it starts with {buf[:4]!r}, not {GGUF_MAGIC!r}")
    cur.pos = 4
    version = cur.scalar(_U32, "version")
    if version not in SUPPORTED_VERSIONS:
        hint = " (a big-endian file? only little-endian GGUF is supported)" if version & 0xFFFF == 0 else ""
        raise cur.error(f"GGUF version {version} is not supported, only {SUPPORTED_VERSIONS}{hint}")
    tensor_count = cur.scalar(_U64, "tensor count")
    kv_count = cur.scalar(_U64, "metadata count")
    # Each metadata entry takes at least 13 bytes and each tensor info at least 24: refuse absurd counts early.
    cur.need(13 * kv_count + 24 * tensor_count, f"{kv_count} metadata entries and {tensor_count} tensor infos")

    metadata: dict[str, Any] = {}
    for i in range(kv_count):
        key = cur.string(f"metadata key {i}")
        if key in metadata:
            raise cur.error(f"metadata key {key!r} appears twice")
        vtype = cur.scalar(_U32, f"value type of {key!r}")
        if key == "general.alignment" and vtype != 4:  # llama.cpp and gguf-py insist on uint32
            raise cur.error(f"general.alignment has value type {vtype}, it must be uint32 (4)")
        metadata[key] = cur.value(vtype, key)

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if alignment <= 0 or alignment & (alignment - 1):
        raise cur.error(f"general.alignment is {alignment!r}, it must be a power of two")

    # (name, ne, type id, relative offset): checked once the data start is known.
    raw_infos = []
    for i in range(tensor_count):
        name = cur.string(f"name of tensor {i}")
        n_dims = cur.scalar(_U32, f"dimension count of tensor {name!r}")
        if n_dims > MAX_DIMS:
            raise cur.error(f"tensor {name!r} has {n_dims} dimensions, GGUF allows at most {MAX_DIMS}")
        cur.need(8 * n_dims, f"shape of tensor {name!r}")
        ne = struct.unpack_from(f"<{n_dims}Q", buf, cur.pos)
        cur.pos += 8 * n_dims
        type_id = cur.scalar(_U32, f"type of tensor {name!r}")
        offset = cur.scalar(_U64, f"data offset of tensor {name!r}")
        raw_infos.append((name, ne, type_id, offset))

    data_start = cur.pos + (-cur.pos) % alignment
    tensors: dict[str, TensorInfo] = {}
    for name, ne, type_id, offset in raw_infos:
        tensors[name] = _tensor_info(cur, name, ne, type_id, offset, alignment, data_start)
    _check_no_overlap(cur, tensors)
    return _Part(path, buf, version, metadata, tensors, alignment)


def _tensor_info(
    cur: _Cursor, name: str, ne: tuple[int, ...], type_id: int, offset: int, alignment: int, data_start: int
) -> TensorInfo:
    what = f"tensor {name!r}"
    ggml_type = GGML_TYPES.get(type_id)
    if ggml_type is None:
        raise cur.error(f"{what} has unknown ggml type id {type_id}")
    row = ne[0] if ne else 1
    if row % ggml_type.block_size:
        raise cur.error(
            f"{what} of type {ggml_type.name} has rows of {row} elements, not a multiple of its block size "
            f"{ggml_type.block_size}"
        )
    n_elements = 1
    for d in ne:
        n_elements *= d
    n_bytes = ggml_type.row_bytes(n_elements)
    if offset % alignment:
        raise cur.error(f"{what} has data offset {offset}, not a multiple of the alignment {alignment}")
    start = data_start + offset
    if start + n_bytes > cur.end:
        raise cur.error(
            f"{what} ({ggml_type.name}, ne={list(ne)}) needs bytes {start}..{start + n_bytes}, "
            f"past the end of the file ({cur.end} bytes): truncated or corrupt"
        )
    return TensorInfo(name, tuple(reversed(ne)), ggml_type, n_bytes, start, cur.path)


def _check_no_overlap(cur: _Cursor, tensors: dict[str, TensorInfo]) -> None:
    previous: TensorInfo | None = None
    for t in sorted((t for t in tensors.values() if t.n_bytes), key=lambda t: t.offset):
        if previous is not None and t.offset < previous.offset + previous.n_bytes:
            raise cur.error(f"tensors {previous.name!r} and {t.name!r} overlap in the file")
        previous = t


class GGUFFile:
    """A GGUF model, one file or all parts of a split one, memory-mapped read-only.

    `metadata` maps keys to plain Python values (int, float, bool, str, or a list of one of them),
    in file order; a split model's metadata is its first part's (which carries `split.*`).
    `tensors` maps names to `TensorInfo`, in file order, part after part.
    `data(name)` is a zero-copy, read-only view of the mapped file:
      - F32, F16, F64, I8..I64: that NumPy dtype, `shape`;
      - BF16: uint16, `shape` (bit patterns: `torch.from_numpy(a).view(torch.bfloat16)`);
      - block types (Q8_0, Q4_K, ...): uint8 `[*shape[:-1], row_bytes]`, one row of blocks per row.
    `close()` unmaps the files; a view still alive keeps its mapping until it is dropped.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        parts = _open_parts(self.path)
        first = parts[0]
        self.paths: tuple[Path, ...] = tuple(p.path for p in parts)
        self.version: int = first.version
        self.alignment: int = first.alignment
        self.metadata: dict[str, Any] = first.metadata
        self.tensors: dict[str, TensorInfo] = {}
        for part in parts:
            self.tensors.update(part.tensors)
        self._buffers: dict[Path, mmap.mmap] | None = {p.path: p.buf for p in parts}

    def data(self, name: str) -> np.ndarray:
        """The tensor's bytes in the mapped file, as described in the class docstring (no copy)."""
        if self._buffers is None:
            raise ValueError(f"{self.path}: the GGUF file is closed")
        info = self.tensors.get(name)
        if info is None:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        buf, t = self._buffers[info.path], info.ggml_type
        if t.dtype is not None:
            return np.frombuffer(buf, t.dtype, info.n_elements, info.offset).reshape(info.shape)
        shape = (*info.shape[:-1], t.row_bytes(info.shape[-1])) if info.shape else (info.n_bytes,)
        return np.frombuffer(buf, np.uint8, info.n_bytes, info.offset).reshape(shape)

    def release(self, name: str) -> None:
        """Drop the tensor's pages from this process (whole pages inside it): after its bytes were
        copied, so resident memory holds the copy only; a later read maps them in again."""
        if self._buffers is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        info = self.tensors[name]
        page = mmap.PAGESIZE
        start = -(-info.offset // page) * page
        stop = (info.offset + info.n_bytes) // page * page
        if stop > start:
            self._buffers[info.path].madvise(mmap.MADV_DONTNEED, start, stop - start)

    def release_all(self) -> None:
        """`release` every tensor: the pages of views still in use are mapped in again as read."""
        if self._buffers is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        for buf in self._buffers.values():
            buf.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        buffers, self._buffers = self._buffers, None
        for buf in (buffers or {}).values():
            with contextlib.suppress(BufferError):  # views are alive: the mapping goes with the last of them
                buf.close()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        parts = f", {len(self.paths)} parts" if len(self.paths) > 1 else ""
        return f"GGUFFile({str(self.path)!r}{parts}, {len(self.metadata)} metadata, {len(self.tensors)} tensors)"


def split_paths(path: Path, count: int) -> list[Path] | None:
    """All part paths of a split GGUF named like `path` (`PREFIX-0000i-of-{count:05d}.gguf`), or None if the
    name does not follow that pattern."""
    m = SPLIT_NAME.match(path.name)
    if m is None or int(m["count"]) != count:
        return None
    return [path.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def _open_parts(path: Path) -> list[_Part]:
    """The parsed parts of the model at `path` (any one part of a split model names them all)."""
    given = _read_part(path)
    parts = [given]
    try:
        count = given.metadata.get("split.count", 1)
        named = SPLIT_NAME.match(path.name)
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise GGUFError(f"{path}: split.count is {count!r}, expected a positive integer")
        if count == 1 and not (named and int(named["count"]) > 1):
            return parts
        if "split.count" not in given.metadata:
            raise GGUFError(f"{path}: named as a part of a split GGUF, but it has no split.count metadata")
        paths = split_paths(path, count)
        if paths is None:
            pattern = f"PREFIX-NNNNN-of-{count:05d}.gguf"
            raise GGUFError(f"{path}: split.count is {count} but the file is not named {pattern}")
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise MissingGGUFFile(
                f"{path}: split GGUF of {count} parts is missing {len(missing)}: {', '.join(missing)}"
            )
        parts = [given if p == path else _read_part(p) for p in paths]
        _check_parts(parts)
        return parts
    except BaseException:
        for part in parts:
            part.buf.close()
        raise


def _check_parts(parts: list[_Part]) -> None:
    """llama.cpp's rules: part i has split.no = i and the common split.count; the tensors, unique across
    parts, number split.tensors.count."""
    seen: dict[str, Path] = {}
    for i, part in enumerate(parts):
        for key, want in (("split.no", i), ("split.count", len(parts))):
            if part.metadata.get(key) != want:
                raise GGUFError(f"{part.path}: {key} is {part.metadata.get(key)!r}, expected {want} for part {i + 1}")
        for name in part.tensors:
            if name in seen:
                raise GGUFError(f"{part.path}: tensor {name!r} is also in {seen[name]}")
            seen[name] = part.path
    expected = parts[0].metadata.get("split.tensors.count")
    if expected != len(seen):
        raise GGUFError(
            f"{parts[0].path}: split.tensors.count is {expected!r} but the {len(parts)} parts hold {len(seen)} tensors"
        )


# llama.cpp's `general.file_type` (llama.h `llama_ftype`, "MOSTLY_" dropped): what ollama and
# llama.cpp call a file's quantization ("Q4_K_M"), which its tensor types alone do not say.
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
    12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
    19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
    26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16",
    36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4_MOE",
}  # fmt: skip


def file_type_name(metadata: dict[str, Any]) -> str:
    """A file's quantization as llama.cpp names it ("Q4_K_M"), from `general.file_type`; "unknown" if unset."""
    file_type = metadata.get("general.file_type")
    return FILE_TYPES.get(file_type, "unknown") if isinstance(file_type, int) else "unknown"
