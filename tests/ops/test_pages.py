"""Weights moved onto huge pages (`ops.pages`): same values, views kept, the pages really huge."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridkv.ops import pages

HUGE = pages.HUGE_PAGE


@pytest.fixture
def huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDKV_HUGE_PAGES", "1")
    pages.available.cache_clear()
    if not pages.available():
        pytest.skip("this kernel lends no transparent huge pages")
    yield
    pages.available.cache_clear()


def anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_move_keeps_values_views_and_parameters(huge_pages: None) -> None:
    big = torch.randn(1024, 1024)  # 4 MiB
    row_view, column_view = big[10:20], big.T[3]  # an offset, a stride
    param = torch.nn.Parameter(torch.randn(700, 1024).to(torch.bfloat16))  # 1.4 MiB: left alone
    small_address = param.data_ptr()
    want = [t.detach().clone() for t in (big, row_view, column_view, param)]

    assert pages.move([big, row_view, column_view, param, big]) == big.nbytes

    for got, expected in zip((big, row_view, column_view, param), want, strict=True):
        assert torch.equal(got, expected)
    assert big.data_ptr() % HUGE == 0
    assert row_view.untyped_storage().data_ptr() == big.untyped_storage().data_ptr()
    assert column_view.stride() == (1024,) and column_view.storage_offset() == 3
    big[12, 0] = 7.0  # still one storage
    assert row_view[2, 0] == 7.0
    assert param.data_ptr() == small_address and isinstance(param, torch.nn.Parameter)
    big.sum().item()  # touched: the kernel backs the range with huge pages
    assert anon_huge_kib(big.data_ptr()) >= HUGE // 1024


def test_turned_off_moves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDKV_HUGE_PAGES", "0")
    pages.available.cache_clear()
    try:
        big = torch.randn(1024, 1024)
        address = big.data_ptr()
        assert not pages.available() and pages.move([big]) == 0 and big.data_ptr() == address
    finally:
        pages.available.cache_clear()


def test_a_storage_that_would_not_fit_twice_stays(huge_pages: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pages, "available_memory", lambda: pages.SPARE + HUGE)
    big = torch.randn(1024, 1024)
    address = big.data_ptr()
    assert pages.move([big]) == 0 and big.data_ptr() == address


def test_a_refused_mapping_leaves_the_storage_where_it_is(huge_pages: None, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(nbytes: int) -> torch.Tensor:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(pages, "_huge_bytes", refuse)
    big = torch.randn(1024, 1024)
    want, address = big.clone(), big.data_ptr()
    assert pages.move([big]) == 0 and big.data_ptr() == address and torch.equal(big, want)


@pytest.mark.parametrize("source", ["checkpoint", "f32.gguf"])
def test_loaded_weights_are_moved_and_compute_the_same(
    source: str, huge_pages: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The default model's embedding and head (3 MiB each) land on huge pages, from its directory
    or from a GGUF file whose pages are then released; its logits do not change."""
    from hybridkv.cache.config import CacheConfig
    from hybridkv.cached_model import CachedModel
    from hybridkv.default_model import default_model_dir
    from hybridkv.models.gguf_writer import write_quantized

    model: Path = default_model_dir()
    if source.endswith(".gguf"):
        write_quantized(model, tmp_path / source, "f32")
        model = tmp_path / source

    def logits() -> tuple[torch.Tensor, list[torch.Tensor]]:
        cm = CachedModel.load(model, cache=CacheConfig(max_model_len=64, max_sequences=1))
        seq = cm.new_sequence()
        out = cm.feed({seq: list(range(5, 4000, 97))}, logits="all")[seq]
        return out, [t for t in cm.model.weight_tensors() if t.untyped_storage().nbytes() >= HUGE]

    moved, big = logits()
    assert len(big) >= 2 and all(t.untyped_storage().data_ptr() % HUGE == 0 for t in big)
    monkeypatch.setenv("HYBRIDKV_HUGE_PAGES", "0")
    pages.available.cache_clear()
    plain, big = logits()
    assert not any(t.untyped_storage().data_ptr() % HUGE == 0 for t in big)
    assert torch.equal(moved, plain)


def test_zeros_are_zeros_on_huge_pages(huge_pages: None) -> None:
    t = pages.zeros((3, 1024, 1024), torch.float32)  # 12 MiB
    assert t.shape == (3, 1024, 1024) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % HUGE == 0 and torch.count_nonzero(t) == 0
    assert anon_huge_kib(t.data_ptr()) >= HUGE // 1024  # written at allocation: huge pages, taken now
    small = pages.zeros((4, 4), torch.bfloat16)  # under a huge page: plain torch.zeros
    assert small.dtype == torch.bfloat16 and torch.count_nonzero(small) == 0


def test_the_cache_streams_its_kv_and_live_states_from_huge_pages(huge_pages: None) -> None:
    from hybridkv.cache.config import CacheConfig, CacheSpec
    from hybridkv.cache.hybrid import HybridCache

    spec = CacheSpec(
        num_attention_layers=1,
        num_kv_heads=2,
        head_dim=64,
        kv_dtype=torch.float32,
        num_linear_layers=1,
        conv_channels=512,
        conv_kernel=4,
        num_value_heads=4,
        key_head_dim=64,
        value_head_dim=64,
    )
    cache = HybridCache(spec, CacheConfig(max_sequences=40, max_model_len=2048))
    streamed = [*cache.tensors.key, *cache.tensors.value, *cache.tensors.delta]
    assert all(t.nbytes >= HUGE and t.data_ptr() % HUGE == 0 for t in streamed)
    assert all(anon_huge_kib(t.data_ptr()) > 0 and torch.count_nonzero(t) == 0 for t in streamed)
