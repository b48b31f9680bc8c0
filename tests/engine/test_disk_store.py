"""The disk store and the model key on their own: files shared by two writers (each with its own
lock descriptor, as two processes have) are always whole; the key tells models, dtypes and
quantizations apart without reading the weights."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch
from chat_model import write_chat_model

from hybridkv import CacheConfig, CachedModel
from hybridkv.engine.disk_store import DiskStore
from hybridkv.engine.disk_tier import model_key
from hybridkv.models.sources import resolve_model

KEY = bytes(range(32))


def test_two_writers_on_one_directory_leave_only_whole_files(tmp_path: Path) -> None:
    stores = [DiskStore(tmp_path, KEY, budget=200 << 10) for _ in range(2)]  # room for ~100 of 400 files
    payloads = {f"{i:032x}.kv": bytes([i % 251]) * (2000 + i) for i in range(200)}

    def write(store: DiskStore, names: list[str]) -> None:
        for name in names:
            store.write(name, [payloads[name][:1000], payloads[name][1000:]])

    names = sorted(payloads)
    threads = [threading.Thread(target=write, args=(s, names[i::2] + names[1 - i :: 2])) for i, s in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    reader = DiskStore(tmp_path, KEY, budget=200 << 10)
    present = reader.names()
    assert 0 < len(present) < len(payloads)  # the budget evicted some
    for name in present:
        assert bytes(reader.read(name) or b"") == payloads[name]
    assert sum(p.stat().st_size for p in tmp_path.glob("*/*.kv")) <= 200 << 10
    assert not list(tmp_path.glob("*/.tmp-*"))


def test_two_writers_taking_turns_keep_to_the_budget_together(tmp_path: Path) -> None:
    """Each store counts the other's writes (the count in the lock file): taking turns, two stores
    that each wrote less than the budget must not hold more than it between them."""
    a, b = (DiskStore(tmp_path, KEY, budget=100 << 10) for _ in range(2))
    for i in range(80):  # 80 x ~2 KiB: 160 KiB written, each store ~80 KiB of it
        (a if i % 2 else b).write(f"{i:032x}.kv", [bytes([i]) * 2000])
        assert sum(p.stat().st_size for p in tmp_path.glob("*/*.kv")) <= 100 << 10, i
    assert a.bytes_used == sum(p.stat().st_size for p in tmp_path.glob("*/*.kv"))  # a wrote last
    b.discard(f"{79:032x}.kv", "a test")  # counted out for a too
    a.write(f"{80:032x}.kv", [b"x" * 2000])
    assert a.bytes_used == sum(p.stat().st_size for p in tmp_path.glob("*/*.kv"))


def test_a_file_under_another_name_is_refused(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, KEY, budget=1 << 20)
    store.write("a.kv", [b"x" * 100])
    (store.dir / "a.kv").rename(store.dir / "b.kv")
    assert store.read("b.kv") is None and not (store.dir / "b.kv").exists()


def test_the_model_key_tells_weights_dtypes_and_quantizations_apart(tmp_path: Path) -> None:
    def key(model: Path, dtype: torch.dtype = torch.float32, quantize: str | None = None) -> bytes:
        cm: Any = CachedModel.load(model, dtype=dtype, cache=CacheConfig(max_sequences=2, max_model_len=64))
        return model_key(resolve_model(model), cm, quantize)[0]

    base = write_chat_model(tmp_path / "base", seed=5)[0]
    same = write_chat_model(tmp_path / "copy", seed=5)[0]
    tuned = write_chat_model(tmp_path / "tuned", seed=6)[0]  # same shapes, names, sizes, header
    assert key(base) == key(same)
    assert len({key(base), key(tuned), key(base, torch.bfloat16), key(base, quantize="q8_0")}) == 4
