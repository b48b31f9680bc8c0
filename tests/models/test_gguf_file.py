"""Our GGUF reader against gguf-py (GGUFWriter writes the files, GGUFReader is the independent reference)."""

from __future__ import annotations

import mmap
import random
import shutil
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from hybridkv.models.gguf import GGML_TYPES, GGUFError, GGUFFile, MissingGGUFFile

SCALARS: list[tuple[str, Any, V]] = [
    ("t.uint8", 255, V.UINT8),
    ("t.int8", -128, V.INT8),
    ("t.uint16", 65535, V.UINT16),
    ("t.int16", -32768, V.INT16),
    ("t.uint32", 2**32 - 1, V.UINT32),
    ("t.int32", -(2**31), V.INT32),
    ("t.float32", 0.1, V.FLOAT32),
    ("t.bool", True, V.BOOL),
    ("t.string", "Ġhello wörld 中文 🙂", V.STRING),
    ("t.empty_string", "", V.STRING),
    ("t.uint64", 2**64 - 1, V.UINT64),
    ("t.int64", -(2**63), V.INT64),
    ("t.float64", -1.0 / 3.0, V.FLOAT64),
]
ARRAYS: list[tuple[str, list[Any], V]] = [
    ("a.uint8", [0, 1, 255], V.UINT8),
    ("a.int8", [-128, 0, 127], V.INT8),
    ("a.uint16", [0, 65535], V.UINT16),
    ("a.int16", [-32768, 7], V.INT16),
    ("a.uint32", [2**32 - 1, 3], V.UINT32),
    ("a.int32", [-(2**31), 0, 2**31 - 1], V.INT32),
    ("a.float32", [0.5, -1e-30, 3.0e38], V.FLOAT32),
    ("a.bool", [True, False, True], V.BOOL),
    ("a.string", ["", "a", "Ġthe", "ĊĊ", "中文", "🙂", "x y"], V.STRING),
    ("a.uint64", [2**64 - 1, 0], V.UINT64),
    ("a.int64", [-(2**63), 2**63 - 1], V.INT64),
    ("a.float64", [1.0 / 3.0, -0.0], V.FLOAT64),
]


def random_bytes(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.integers(0, 256, shape, dtype=np.uint8)


def make_tensors(seed: int = 0) -> list[tuple[str, np.ndarray, Q | None]]:
    """(name, array, raw type): odd shapes, every layout family, a 3-D expert tensor, sizes not multiples of 32."""
    rng = np.random.default_rng(seed)
    return [
        ("blk.0.odd.weight", rng.standard_normal((3, 5, 7)).astype(np.float32), None),
        ("blk.0.vec.weight", np.array([1.5], dtype=np.float32), None),
        ("blk.0.f16.weight", rng.standard_normal((7, 9)).astype(np.float16), None),
        ("blk.0.bf16.weight", rng.integers(0, 2**16, (4, 6), dtype=np.uint16), Q.BF16),
        ("blk.0.q8_0.weight", random_bytes(rng, (5, 3 * 34)), Q.Q8_0),  # rows of 96
        ("blk.0.q6_k.weight", random_bytes(rng, (1, 210)), Q.Q6_K),  # 210 bytes: the next tensor is padded
        ("blk.0.ffn_up_exps.weight", random_bytes(rng, (3, 2, 2 * 144)), Q.Q4_K),  # [E, N, row_bytes], rows of 512
        ("blk.0.i32", np.arange(6, dtype=np.int32).reshape(2, 3), None),
    ]


def write_gguf(
    path: Path,
    tensors: list[tuple[str, np.ndarray, Q | None]] | None = None,
    metadata: list[tuple[str, Any, V, V | None]] | None = None,
    **writer_args: Any,
) -> list[Path]:
    """Writes with gguf-py's GGUFWriter (split files too, via split_max_tensors); returns the paths written."""
    writer = gguf.GGUFWriter(path, "test", **writer_args)
    for key, value, vtype, sub_type in metadata or []:
        writer.add_key_value(key, value, vtype, sub_type)
    for name, array, raw_dtype in make_tensors() if tensors is None else tensors:
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    paths = list(writer.format_shard_names(path))
    writer.close()
    return paths


def full_metadata() -> list[tuple[str, Any, V, V | None]]:
    return [(k, v, t, None) for k, v, t in SCALARS] + [(k, v, V.ARRAY, t) for k, v, t in ARRAYS]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "model.gguf", metadata=full_metadata())[0]


def reference_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def assert_matches_reference(ours: GGUFFile, path: Path) -> None:
    """Every tensor gguf-py finds in `path` is in `ours`, at the same place, with the same bytes."""
    reader = gguf.GGUFReader(path)
    for ref in reader.tensors:
        info = ours.tensors[ref.name]
        assert info.path == path
        assert info.shape == tuple(reversed(ref.shape.tolist()))
        assert (info.type_id, info.type_name) == (int(ref.tensor_type), ref.tensor_type.name)
        assert (info.offset, info.n_bytes, info.n_elements) == (ref.data_offset, ref.n_bytes, ref.n_elements)
        view = ours.data(ref.name)
        if info.type_name == "BF16":  # gguf-py: uint8 [..., 2 * n]; ours: uint16 [..., n]
            view = view.view(np.uint8)
        assert view.dtype == ref.data.dtype and view.shape == ref.data.shape
        np.testing.assert_array_equal(view, ref.data)


def test_metadata_matches_gguf_py(model_path: Path) -> None:
    with GGUFFile(model_path) as ours:
        reference = reference_metadata(gguf.GGUFReader(model_path))
        assert list(ours.metadata) == list(reference)  # same keys, file order
        assert ours.metadata == reference
        assert ours.version == 3 and ours.alignment == 32
    for key, value, _ in SCALARS:
        assert type(ours.metadata[key]) is type(value), key  # plain Python values, not NumPy scalars
    for key, values, _ in ARRAYS:
        assert [type(v) for v in ours.metadata[key]] == [type(v) for v in values], key
    assert ours.metadata["a.string"] == ARRAYS[8][1]


def test_tensors_match_gguf_py(model_path: Path) -> None:
    with GGUFFile(model_path) as ours:
        assert list(ours.tensors) == [name for name, _, _ in make_tensors()]
        assert_matches_reference(ours, model_path)
        experts = ours.tensors["blk.0.ffn_up_exps.weight"]
        assert (experts.shape, experts.type_name) == ((3, 2, 512), "Q4_K")
        assert ours.data(experts.name).shape == (3, 2, 288)


def test_data_is_the_written_values(model_path: Path) -> None:
    with GGUFFile(model_path) as ours:
        for name, array, _ in make_tensors():
            view = ours.data(name)
            np.testing.assert_array_equal(view, array)
            assert view.dtype == array.dtype
        # BF16 comes as uint16 bit patterns, which torch reinterprets in place
        bf16 = torch.from_numpy(np.array(ours.data("blk.0.bf16.weight"))).view(torch.bfloat16)
        assert bf16.dtype == torch.bfloat16 and bf16.shape == (4, 6)
        np.testing.assert_array_equal(bf16.view(torch.int16).numpy().view(np.uint16), make_tensors()[3][1])


def test_released_pages_read_the_same_values_again(model_path: Path) -> None:
    with GGUFFile(model_path) as ours:
        views = {name: ours.data(name) for name, _, _ in make_tensors()}
        ours.release("blk.0.odd.weight")
        ours.release_all()
        for name, array, _ in make_tensors():
            np.testing.assert_array_equal(views[name], array)


def mapping_of(view: np.ndarray) -> object:
    base: object = view
    while isinstance(base, np.ndarray):
        base = base.base
    return base.obj if isinstance(base, memoryview) else base


def test_data_views_are_zero_copy_and_read_only(model_path: Path) -> None:
    ours = GGUFFile(model_path)
    for name in ours.tensors:
        view = ours.data(name)
        assert isinstance(mapping_of(view), mmap.mmap) and not view.flags.owndata
        assert np.shares_memory(view, ours.data(name))  # two calls, one memory: the file's pages
        assert not view.flags.writeable
    mapping = mapping_of(ours.data("blk.0.i32"))
    assert isinstance(mapping, mmap.mmap)
    whole = np.frombuffer(mapping, np.uint8)
    info = ours.tensors["blk.0.i32"]
    assert np.shares_memory(ours.data(info.name), whole[info.offset : info.offset + info.n_bytes])
    kept = ours.data("blk.0.odd.weight")
    ours.close()
    np.testing.assert_array_equal(kept, make_tensors()[0][1])  # a live view keeps its mapping
    with pytest.raises(ValueError, match="closed"):
        ours.data("blk.0.odd.weight")


def test_custom_alignment(tmp_path: Path) -> None:
    path = tmp_path / "aligned.gguf"
    writer = gguf.GGUFWriter(path, "test")
    writer.add_custom_alignment(64)
    for name, array, raw_dtype in make_tensors():
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with GGUFFile(path) as ours:
        assert ours.alignment == 64 and ours.metadata["general.alignment"] == 64
        assert all(t.offset % 64 == 0 for t in ours.tensors.values())
        assert_matches_reference(ours, path)


def test_version_2(tmp_path: Path, model_path: Path) -> None:
    raw = bytearray(model_path.read_bytes())
    raw[4:8] = struct.pack("<I", 2)
    path = tmp_path / "v2.gguf"
    path.write_bytes(raw)
    with GGUFFile(path) as ours:
        assert ours.version == 2
        assert ours.metadata == reference_metadata(gguf.GGUFReader(path))
        assert_matches_reference(ours, path)


def test_no_tensors(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "meta.gguf", tensors=[], metadata=full_metadata())[0]
    with GGUFFile(path) as ours:
        assert ours.tensors == {} and ours.metadata == reference_metadata(gguf.GGUFReader(path))


def test_a_vocabulary(tmp_path: Path) -> None:
    rng = random.Random(0)
    alphabet = "abcxyzĠĊ é中文🙂\n\0"
    tokens = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12))) for _ in range(3000)]
    metadata = [
        ("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING),
        ("tokenizer.ggml.token_type", [rng.randint(1, 6) for _ in tokens], V.ARRAY, V.INT32),
        (
            "tokenizer.ggml.merges",
            [f"{a} {b}" for a, b in zip(tokens[:-1], tokens[1:], strict=True)],
            V.ARRAY,
            V.STRING,
        ),
    ]
    path = write_gguf(tmp_path / "vocab.gguf", metadata=metadata)[0]
    with GGUFFile(path) as ours:
        assert ours.metadata == reference_metadata(gguf.GGUFReader(path))
        assert ours.metadata["tokenizer.ggml.tokens"] == tokens


def test_type_table_matches_gguf_py() -> None:
    for qtype, (block_size, type_size) in gguf.GGML_QUANT_SIZES.items():
        ours = GGML_TYPES[int(qtype)]
        assert (ours.name, ours.block_size, ours.type_size) == (qtype.name, block_size, type_size)


# --- split files (llama.cpp's gguf-split layout: metadata in part 1, split.* in every part) ---


def write_split(tmp_path: Path, **writer_args: Any) -> list[Path]:
    paths = write_gguf(tmp_path / "model.gguf", metadata=full_metadata(), split_max_tensors=3, **writer_args)
    assert [p.name for p in paths][-1] == f"model-{len(paths):05d}-of-{len(paths):05d}.gguf"
    return paths


@pytest.mark.parametrize("small_first_shard", [False, True], ids=["tensors-in-every-part", "metadata-only-first"])
def test_split_files_open_as_one(tmp_path: Path, small_first_shard: bool) -> None:
    paths = write_split(tmp_path, small_first_shard=small_first_shard)
    assert len(paths) == (4 if small_first_shard else 3)
    for given in (paths[0], paths[-1]):  # any part names them all
        with GGUFFile(given) as ours:
            assert ours.paths == tuple(paths)
            assert ours.metadata == reference_metadata(gguf.GGUFReader(paths[0]))
            assert ours.metadata["split.count"] == len(paths) and ours.metadata["t.string"] == SCALARS[8][1]
            assert list(ours.tensors) == [name for name, _, _ in make_tensors()]
            for path in paths:
                assert_matches_reference(ours, path)


def test_split_missing_parts_are_listed(tmp_path: Path) -> None:
    paths = write_split(tmp_path)
    paths[1].unlink()
    paths[2].unlink()
    with pytest.raises(MissingGGUFFile, match="missing 2") as e:
        GGUFFile(paths[0])
    assert str(paths[1]) in str(e.value) and str(paths[2]) in str(e.value)


def test_split_part_out_of_place(tmp_path: Path) -> None:
    paths = write_split(tmp_path)
    shutil.copy(paths[2], paths[1])
    with pytest.raises(GGUFError, match="split.no is 2, expected 1"):
        GGUFFile(paths[0])


def test_split_part_not_named_as_a_split(tmp_path: Path) -> None:
    paths = write_split(tmp_path)
    renamed = paths[0].rename(tmp_path / "renamed.gguf")
    with pytest.raises(GGUFError, match="split.count is 3 but the file is not named"):
        GGUFFile(renamed)


def test_split_tensor_count_checked(tmp_path: Path) -> None:
    paths = write_split(tmp_path)
    raw = bytearray(paths[0].read_bytes())
    at = key_value_at(raw, "split.tensors.count") + 4
    raw[at : at + 4] = struct.pack("<i", 9)
    paths[0].write_bytes(raw)
    with pytest.raises(GGUFError, match="split.tensors.count is 9 but the 3 parts hold 8 tensors"):
        GGUFFile(paths[0])


# --- damaged files: each a clear error naming the file ---


def key_value_at(raw: bytearray, key: str) -> int:
    """Byte position of the u32 value type that follows metadata `key`."""
    encoded = key.encode()
    return raw.index(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded)


def tensor_info_at(raw: bytearray, name: str) -> int:
    """Byte position of tensor `name`'s n_dims; ne[] follows, then u32 type and u64 offset."""
    return key_value_at(raw, name)


def set_tensor_offset(name: str, offset: Callable[[int], int]) -> Callable[[bytearray], None]:
    def damage(raw: bytearray) -> None:
        at = tensor_info_at(raw, name)
        at += 4 + 8 * struct.unpack_from("<I", raw, at)[0] + 4
        raw[at : at + 8] = struct.pack("<Q", offset(struct.unpack_from("<Q", raw, at)[0]))

    return damage


def set_u32(position: Callable[[bytearray], int], value: int) -> Callable[[bytearray], None]:
    def damage(raw: bytearray) -> None:
        at = position(raw)
        raw[at : at + 4] = struct.pack("<I", value)

    return damage


def truncate(keep: Callable[[bytearray], int]) -> Callable[[bytearray], None]:
    def damage(raw: bytearray) -> None:
        del raw[keep(raw) :]

    return damage


def replace(old: bytes, new: bytes) -> Callable[[bytearray], None]:
    def damage(raw: bytearray) -> None:
        at = raw.index(old)
        raw[at : at + len(old)] = new

    return damage


def q8_ne0(raw: bytearray) -> int:
    return tensor_info_at(raw, "blk.0.q8_0.weight") + 4


DAMAGE: dict[str, tuple[Callable[[bytearray], None], str]] = {
    "bad magic": (replace(b"GGUF", b"GGML"), r"not a GGUF file: it starts with b'GGML'"),
    "empty": (truncate(lambda raw: 0), "truncated: 0 bytes"),
    "cut in a string array": (
        truncate(lambda raw: key_value_at(raw, "a.string") + 16 + 70),  # in the length of string 6, "x y"
        "truncated: string 6 of array 'a.string' runs past the end",
    ),
    "cut in a numeric array": (
        truncate(lambda raw: key_value_at(raw, "a.float64") + 16 + 12),
        r"truncated: 2 elements of array 'a.float64' at byte \d+ needs 16 bytes",
    ),
    "cut in tensor data": (truncate(lambda raw: len(raw) - 20), r"tensor 'blk.0.i32' .* past the end of the file"),
    "offset past the end": (
        set_tensor_offset("blk.0.f16.weight", lambda o: o + 2**40),
        r"tensor 'blk.0.f16.weight' \(F16, ne=\[9, 7\]\) needs bytes .* past the end",
    ),
    "misaligned offset": (
        set_tensor_offset("blk.0.q8_0.weight", lambda o: o + 2),
        r"tensor 'blk.0.q8_0.weight' has data offset \d+, not a multiple of the alignment 32",
    ),
    "overlapping tensors": (
        set_tensor_offset("blk.0.i32", lambda o: 0),
        r"tensors 'blk.0.odd.weight' and 'blk.0.i32' overlap",
    ),
    "unknown value type": (set_u32(lambda raw: key_value_at(raw, "t.int8"), 13), "'t.int8' has unknown value type 13"),
    "unknown array element type": (
        set_u32(lambda raw: key_value_at(raw, "a.int8") + 4, 99),
        "array 'a.int8' has unknown element type 99",
    ),
    "nested array": (set_u32(lambda raw: key_value_at(raw, "a.int8") + 4, 9), "nested arrays are not valid"),
    "unknown ggml type": (
        set_u32(lambda raw: q8_ne0(raw) + 16, 5),
        "tensor 'blk.0.q8_0.weight' has unknown ggml type id 5",
    ),
    "row not whole blocks": (
        set_u32(q8_ne0, 95),
        "'blk.0.q8_0.weight' of type Q8_0 has rows of 95 elements, not a multiple of its block size 32",
    ),
    "too many dims": (set_u32(lambda raw: tensor_info_at(raw, "blk.0.vec.weight"), 5), "5 dimensions"),
    "version 1": (set_u32(lambda raw: 4, 1), r"version 1 is not supported"),
    "big-endian": (replace(b"GGUF\x03\x00\x00\x00", b"GGUF\x00\x00\x00\x03"), "big-endian"),
    "invalid UTF-8": (replace("中文".encode(), b"\xff\xfe\xfd\xfc\xfb\xfa"), "is not valid UTF-8"),
    "duplicate key": (replace(b"t.uint16", b"t.uint32"), "metadata key 't.uint32' appears twice"),
    "absurd counts": (
        replace(struct.pack("<QQ", 8, len(SCALARS) + len(ARRAYS) + 1), struct.pack("<QQ", 8, 2**60)),
        "truncated: 1152921504606846976 metadata entries",
    ),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_file_is_a_clear_error(tmp_path: Path, model_path: Path, case: str) -> None:
    damage, message = DAMAGE[case]
    raw = bytearray(model_path.read_bytes())
    damage(raw)
    path = tmp_path / "damaged.gguf"
    path.write_bytes(raw)
    with pytest.raises(GGUFError, match=message) as e:
        GGUFFile(path)
    assert str(e.value).startswith(f"{path}: ")


def test_bad_alignment(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "a.gguf", metadata=[("general.alignment", 48, V.UINT32, None)])[0]
    with pytest.raises(GGUFError, match="general.alignment is 48, it must be a power of two"):
        GGUFFile(path)


def test_alignment_must_be_uint32(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "a.gguf", metadata=[("general.alignment", 32, V.UINT64, None)])[0]
    with pytest.raises(GGUFError, match="general.alignment has value type 10, it must be uint32"):
        GGUFFile(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(MissingGGUFFile, match="no such GGUF file"):
        GGUFFile(tmp_path / "absent.gguf")


# --- speed: a Qwen-sized vocabulary (gguf-py's reader takes ~13 s) ---


@pytest.mark.slow
def test_opens_a_152k_vocabulary_fast(tmp_path: Path) -> None:
    rng = random.Random(0)
    alphabet = [chr(c) for c in range(33, 127)] + ["Ġ", "Ċ", "ĉ", "é", "ä¸Ń"]
    tokens = ["".join(rng.choices(alphabet, k=rng.randint(1, 12))) for _ in range(151_936)]
    merges = [f"{rng.choice(tokens)} {rng.choice(tokens)}" for _ in range(151_387)]
    metadata = [
        ("tokenizer.ggml.model", "gpt2", V.STRING, None),
        ("tokenizer.ggml.pre", "qwen2", V.STRING, None),
        ("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING),
        ("tokenizer.ggml.token_type", [1] * len(tokens), V.ARRAY, V.INT32),
        ("tokenizer.ggml.merges", merges, V.ARRAY, V.STRING),
    ]
    path = write_gguf(tmp_path / "vocab.gguf", metadata=metadata)[0]
    times = []
    for _ in range(3):
        start = time.perf_counter()
        with GGUFFile(path) as ours:
            times.append(time.perf_counter() - start)
            metadata_ours = ours.metadata
    start = time.perf_counter()
    reference = reference_metadata(gguf.GGUFReader(path))
    reference_time = time.perf_counter() - start
    print(f"\nopen a 152k-token vocabulary: ours {min(times):.3f} s (best of 3), gguf-py {reference_time:.1f} s")
    assert metadata_ours == reference
    assert min(times) < 1.0
