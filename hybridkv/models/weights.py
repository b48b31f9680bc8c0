"""Reading safetensors checkpoints into a model, one tensor at a time, and checking they fit in memory.

This module knows files, not architectures: a model file says which checkpoint tensors make each
of its parameters (a `Layout` of `Piece`s, built by its one mapping function); `load_weights`
checks the whole layout against the checkpoint's headers first, then streams the tensors in.
Files are memory-mapped, so peak memory is the model plus the one tensor being copied.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError, safe_open

from hybridkv.errors import NotSupported
from hybridkv.ops.pages import available_memory

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
COMPUTE_DTYPES = (torch.float32, torch.bfloat16)
MEMORY_HEADROOM = 0.9  # use at most this share of available memory
CACHE_SHARE = 0.5  # a cache sized by default takes at most this share of what the weights leave

_FLOAT_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_MAX_LISTED = 5


class WeightsError(ValueError):
    """A checkpoint does not match the model: the message names the file, the tensor and the shapes."""


class MissingWeightsFile(WeightsError, FileNotFoundError):
    """A checkpoint file (or the whole checkpoint) is absent."""


class InsufficientMemory(MemoryError):
    """Weights plus cache would not fit in available memory; the message gives the numbers
    (`numbers`, without the advice, for a command line to advise in its own flags)."""

    def __init__(self, numbers: str, advice: str = "") -> None:
        super().__init__(f"{numbers}; {advice}" if advice else numbers)
        self.numbers = numbers


WriteFn = Callable[[torch.Tensor, torch.Tensor], None]
"""(param, checkpoint tensor) -> None: writes the tensor into (part of) our parameter."""


def copy_into(param: torch.Tensor, tensor: torch.Tensor) -> None:
    param.copy_(tensor)


@dataclass(frozen=True, slots=True)
class Piece:
    """One checkpoint tensor: its name, its expected shape, and how it is written into a parameter.

    `write(param, tensor)` receives the tensor in its checkpoint dtype; `param.copy_` casts.
    """

    name: str
    shape: tuple[int, ...]
    write: WriteFn = copy_into


Layout = dict[str, list[Piece]]
"""Our parameter name -> the checkpoint pieces that fill it (together, all of it)."""


class TensorSource(Protocol):
    """Named checkpoint tensors, as `load_weights` reads them: `Checkpoint` (safetensors) and
    `GGUFCheckpoint` (a GGUF file under Hugging Face names)."""

    description: str
    file_of: dict[str, Path]

    @property
    def names(self) -> set[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def numel(self, name: str) -> int: ...

    def dtype_name(self, name: str) -> str: ...

    def read(self, name: str) -> torch.Tensor: ...


class Checkpoint:
    """The safetensors tensors of a model directory: names, shapes and lazy reads.

    Either `model.safetensors` or a sharded `model.safetensors.index.json` with its shard files.
    """

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self._weight_map: dict[str, str] = {}
        index = self.model_dir / INDEX_FILE
        single = self.model_dir / SINGLE_FILE
        if index.is_file():
            self.description = str(index)
            files = self._shards(index)
        elif single.is_file():
            self.description = str(single)
            files = [single]
        else:
            raise MissingWeightsFile(f"{self.model_dir}: no weights found (looked for {SINGLE_FILE} and {INDEX_FILE})")
        self._handles = {path: _open_safetensors(path) for path in files}
        self.file_of: dict[str, Path] = {}
        for path, handle in self._handles.items():
            self.file_of.update(dict.fromkeys(handle.keys(), path))
        if index.is_file():
            self._check_index(index)

    def _shards(self, index: Path) -> list[Path]:
        try:
            self._weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise WeightsError(f"{index}: not a safetensors index (needs a 'weight_map' object): {e}") from e
        files = [self.model_dir / f for f in sorted(set(self._weight_map.values()))]
        for path in files:
            if not path.is_file():
                needed = [n for n, f in self._weight_map.items() if self.model_dir / f == path]
                raise MissingWeightsFile(
                    f"{path}: shard file missing; {index.name} lists {len(needed)} tensors in it, "
                    f"e.g. {needed[:_MAX_LISTED]}"
                )
        return files

    def _check_index(self, index: Path) -> None:
        for name, file in self._weight_map.items():
            if self.file_of.get(name) != self.model_dir / file:
                raise WeightsError(f"{self.model_dir / file}: tensor {name!r} listed in {index.name} is not in it")

    @property
    def names(self) -> set[str]:
        return set(self.file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self.file_of[name]].get_slice(name).get_shape())

    def numel(self, name: str) -> int:
        return math.prod(self.shape(name))

    def dtype_name(self, name: str) -> str:
        return self._handles[self.file_of[name]].get_slice(name).get_dtype()

    def read(self, name: str) -> torch.Tensor:
        return self._handles[self.file_of[name]].get_tensor(name)


def _open_safetensors(path: Path) -> Any:
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as e:  # safetensors checks the header and that the data covers the file
        detail = str(e).removeprefix("Error while deserializing header: ")
        raise WeightsError(f"{path}: not a valid safetensors file, truncated or corrupt ({detail})") from None


def load_weights(
    params: dict[str, torch.Tensor],
    layout: Layout,
    checkpoint: TensorSource,
    ignore: Callable[[str], bool] = lambda name: False,
) -> None:
    """Fill `params` (our name -> tensor) from `checkpoint` following `layout`.

    Everything is checked before any data is read: every tensor the layout needs exists with the
    expected shape and a float dtype, and the checkpoint holds nothing else except `ignore`d names
    (extra tensors mean a different architecture).
    """
    if set(params) != set(layout):
        raise AssertionError(f"layout does not cover the model: {sorted(set(params) ^ set(layout))[:10]}")
    where = checkpoint.description
    pieces = [piece for name in layout for piece in layout[name]]
    missing = [p.name for p in pieces if p.name not in checkpoint.file_of]
    if missing:
        raise WeightsError(
            f"{where}: {len(missing)} tensor(s) missing, e.g. {missing[:_MAX_LISTED]}; "
            "is this checkpoint the architecture its config.json says?"
        )
    for piece in pieces:
        actual = checkpoint.shape(piece.name)
        if actual != piece.shape:
            raise WeightsError(
                f"{checkpoint.file_of[piece.name]}: tensor {piece.name!r} has shape {list(actual)}, "
                f"expected {list(piece.shape)} from config.json"
            )
        dtype = checkpoint.dtype_name(piece.name)
        if dtype not in _FLOAT_DTYPES:
            raise NotSupported(
                f"{checkpoint.file_of[piece.name]}: tensor {piece.name!r} is {dtype}; only F32, BF16 and F16 "
                "checkpoints are supported"
            )
    used = {p.name for p in pieces}
    unexpected = sorted(n for n in checkpoint.names - used if not ignore(n))
    if unexpected:
        raise WeightsError(
            f"{where}: {len(unexpected)} unexpected tensor(s), e.g. {unexpected[:_MAX_LISTED]}; "
            "the checkpoint does not match the architecture in config.json"
        )
    progress = LoadProgress(sum(params[name].nbytes for name in layout), where)
    with torch.no_grad():
        for name, param_pieces in layout.items():
            for piece in param_pieces:
                piece.write(params[name], checkpoint.read(piece.name))
            progress.advance(params[name].nbytes)
    progress.close()


class LoadProgress:
    """A one-line progress bar on stderr while loading large weights (only on a terminal)."""

    MIN_BYTES = 256 << 20

    def __init__(self, total: int, description: str) -> None:
        self.total, self.done, self.description = total, 0, description
        self.enabled = total >= self.MIN_BYTES and sys.stderr.isatty()
        self._shown = -1

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        percent = 100 * self.done // max(self.total, 1)
        if self.enabled and percent != self._shown:
            self._shown = percent
            bar = "#" * (percent // 4)
            sys.stderr.write(f"\rloading {self.description} [{bar:<25}] {percent:3d}% of {format_bytes(self.total)}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


@dataclass(frozen=True)
class MemoryShare:
    """The memory one process plans its weights and cache in. Alone on the machine (the default),
    all of it: MemAvailable, read when asked. When several processes load the same model (`serve
    --replicas`), the one that starts them reads MemAvailable once, before any of them loads, and
    gives each the same share: `copies` processes hold the weights (the replicas and a loaded
    spare) and `caches` of them fill a cache (the replicas: a spare's pools stay untouched until it
    takes a replica's place). Read by each worker after the others had loaded, MemAvailable would
    give every one a cache sized as if it were alone."""

    available: int | None = None  # bytes; None: this machine's MemAvailable now
    copies: int = 1
    caches: int = 1

    def __post_init__(self) -> None:
        if self.copies < 1 or not 1 <= self.caches <= self.copies:
            raise ValueError(
                f"a memory share needs 1 <= caches <= copies, got {self.caches} caches, {self.copies} copies"
            )
        if self.available is not None and self.available < 0:
            raise ValueError(f"available memory must be >= 0 bytes, got {self.available}")

    @classmethod
    def parse(cls, text: str) -> MemoryShare:
        """`str(share)`'s form, AVAILABLE,COPIES,CACHES (what `serve --replicas` passes its workers)."""
        try:
            available, copies, caches = (int(part) for part in text.split(","))
        except ValueError:
            raise ValueError(f"a memory share is AVAILABLE_BYTES,COPIES,CACHES, got {text!r}") from None
        return cls(available, copies, caches)

    def __str__(self) -> str:
        return f"{self.available_bytes()},{self.copies},{self.caches}"

    def available_bytes(self) -> int:
        return available_memory() if self.available is None else self.available

    def measure(self) -> MemoryShare:
        """This share with MemAvailable read now, if it was left to be read."""
        return self if self.available is not None else dataclasses.replace(self, available=available_memory())

    @property
    def shared(self) -> bool:
        return self.copies > 1


def check_memory_fit(weight_bytes: int, cache_bytes: int, share: MemoryShare | None = None) -> None:
    """Raise `InsufficientMemory` when weights + cache exceed 90% of available memory (with a
    `share`: its copies of the weights and its caches, each cache `cache_bytes`)."""
    share = share or MemoryShare()
    available = share.available_bytes()
    needed = share.copies * weight_bytes + share.caches * cache_bytes
    limit = int(MEMORY_HEADROOM * available)
    if needed > limit:
        if share.shared:
            whose = "the replicas and a loaded spare" if share.copies > share.caches else "the replicas"
            what = (
                f"{share.copies} copies of the weights ({format_bytes(weight_bytes)} each: {whose}) + "
                f"{share.caches} caches ({format_bytes(cache_bytes)} each)"
            )
        else:
            what = f"weights {format_bytes(weight_bytes)} + cache {format_bytes(cache_bytes)}"
        raise InsufficientMemory(
            f"{what} = {format_bytes(needed)}, more than {MEMORY_HEADROOM:.0%} of available memory "
            f"({format_bytes(limit)} of {format_bytes(available)})",
            "use a smaller cache budget, bfloat16 weights, or a machine with more memory",
        )


def cache_room(weight_bytes: int, share: MemoryShare | None = None) -> int:
    """The most a cache sized by default may take (`fit_pools`): `CACHE_SHARE` of what
    `check_memory_fit`'s limit leaves beside the weights, so the machine keeps room for the rest;
    with a `share`, beside all its copies of the weights, split between its caches."""
    share = share or MemoryShare()
    left = int(MEMORY_HEADROOM * share.available_bytes()) - share.copies * weight_bytes
    return max(0, int(CACHE_SHARE * left) // share.caches)


def format_bytes(n: int) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    return f"{n / (1 << 20):.1f} MiB"
