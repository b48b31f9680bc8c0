"""Checkpoint loading: layouts that must load identically, and damage that must be named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import TinyCache

from hybridkv.models import (
    InsufficientMemory,
    MemoryShare,
    MissingWeightsFile,
    WeightsError,
    check_memory_fit,
    load_model,
    weights_nbytes,
)
from hybridkv.models.weights import cache_room

Tensors = dict[str, torch.Tensor]


def read_tensors(path: Path) -> Tensors:
    return load_file(path / "model.safetensors")


def write_checkpoint(src: Path, dst: Path, tensors: Tensors, shards: int = 1) -> Path:
    """A copy of checkpoint `src` with `tensors` as its weights, in one file or `shards` files + index."""
    dst.mkdir(exist_ok=True)
    shutil.copy(src / "config.json", dst / "config.json")
    if shards == 1:
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
        return dst
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[s::shards]}
        save_file(part, dst / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def assert_same_weights(a, b) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


def logits(model, tokens=(3, 1, 4, 1, 5, 9, 2, 6)) -> torch.Tensor:
    return TinyCache(model.config, 1, 16).run(model, [(0, list(tokens))])[0]


def test_a_directory_without_weights_is_reported(tiny_checkpoint, tmp_path):
    shutil.copy(tiny_checkpoint[1] / "config.json", tmp_path)
    with pytest.raises(MissingWeightsFile, match="model.safetensors") as e:
        load_model(tmp_path)
    assert isinstance(e.value, FileNotFoundError) and str(tmp_path) in str(e.value)


def test_a_missing_shard_is_named(tiny_checkpoint, tmp_path):
    path = write_checkpoint(tiny_checkpoint[1], tmp_path / "ckpt", read_tensors(tiny_checkpoint[1]), shards=2)
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        load_model(path)


def test_a_missing_tensor_is_named_with_its_file(tiny_checkpoint, tmp_path):
    tensors = read_tensors(tiny_checkpoint[1])
    del tensors["model.layers.1.linear_attn.A_log"]
    path = write_checkpoint(tiny_checkpoint[1], tmp_path / "ckpt", tensors)
    with pytest.raises(WeightsError, match="model.layers.1.linear_attn.A_log") as e:
        load_model(path)
    assert str(path / "model.safetensors") in str(e.value)


def test_a_misshapen_tensor_is_named_with_both_shapes(tiny_checkpoint, tmp_path):
    tensors = read_tensors(tiny_checkpoint[1])
    tensors["model.layers.3.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    path = write_checkpoint(tiny_checkpoint[1], tmp_path / "ckpt", tensors)
    with pytest.raises(WeightsError) as e:
        load_model(path)
    message = str(e.value)
    for part in (
        str(path / "model.safetensors"),
        "model.layers.3.self_attn.k_proj.weight",
        "[16, 64]",
        "[32, 64]",
    ):
        assert part in message


def test_unexpected_tensors_mean_another_architecture(tiny_checkpoint, tmp_path):
    tensors = {
        **read_tensors(tiny_checkpoint[1]),
        "model.layers.0.mlp.experts.4.up_proj.weight": torch.zeros(32, 64),
    }
    path = write_checkpoint(tiny_checkpoint[1], tmp_path / "ckpt", tensors)
    with pytest.raises(WeightsError, match=r"unexpected.*model\.layers\.0\.mlp\.experts\.4\.up_proj\.weight"):
        load_model(path)


def test_mtp_tensors_are_ignored(tiny_checkpoint, tmp_path):
    tensors = {
        **read_tensors(tiny_checkpoint[1]),
        "mtp.fc.weight": torch.ones(64, 128),
        "mtp.norm.weight": torch.ones(64),
    }
    model = load_model(write_checkpoint(tiny_checkpoint[1], tmp_path / "ckpt", tensors))
    assert_same_weights(model, load_model(tiny_checkpoint[1]))


def test_fused_expert_layout_loads_to_identical_logits(tiny_checkpoint, tmp_path):
    tensors = read_tensors(tiny_checkpoint[1])
    for i in range(4):
        prefix = f"model.layers.{i}.mlp.experts."
        gate_up, down = [], []
        for e in range(4):
            gate = tensors.pop(f"{prefix}{e}.gate_proj.weight")
            gate_up.append(torch.cat([gate, tensors.pop(f"{prefix}{e}.up_proj.weight")]))
            down.append(tensors.pop(f"{prefix}{e}.down_proj.weight"))
        tensors[prefix + "gate_up_proj"] = torch.stack(gate_up)  # [E, 2I, D], gate rows first
        tensors[prefix + "down_proj"] = torch.stack(down)  # [E, D, I]
    fused = load_model(write_checkpoint(tiny_checkpoint[1], tmp_path / "ckpt", tensors))
    per_expert = load_model(tiny_checkpoint[1])
    assert_same_weights(fused, per_expert)
    assert torch.equal(logits(fused), logits(per_expert))


def test_sharded_checkpoint_loads(tiny_checkpoint, tmp_path):
    path = write_checkpoint(tiny_checkpoint[1], tmp_path / "ckpt", read_tensors(tiny_checkpoint[1]), shards=3)
    assert not (path / "model.safetensors").exists()
    assert_same_weights(load_model(path), load_model(tiny_checkpoint[1]))


def test_bf16_checkpoint_loads_into_either_compute_dtype(make_checkpoint):
    _, path = make_checkpoint("bf16", dtype=torch.bfloat16)
    stored = read_tensors(path)["model.embed_tokens.weight"]
    assert stored.dtype == torch.bfloat16
    assert torch.equal(load_model(path, torch.float32).embed, stored.float())
    assert torch.equal(load_model(path, torch.bfloat16).embed, stored)


def test_tied_checkpoint_has_no_lm_head_and_a_stray_one_is_ignored(make_checkpoint, tmp_path):
    _, path = make_checkpoint("tied", tie_word_embeddings=True)
    tensors = read_tensors(path)
    assert "lm_head.weight" not in tensors
    model = load_model(path)
    assert model.lm_head is None
    with_head = write_checkpoint(path, tmp_path / "ckpt", {**tensors, "lm_head.weight": torch.zeros(128, 64)})
    assert torch.equal(logits(load_model(with_head)), logits(model))


def test_only_float32_and_bfloat16_compute(tiny_checkpoint):
    with pytest.raises(ValueError, match="bfloat16"):
        load_model(tiny_checkpoint[1], torch.float16)


def test_weights_nbytes_counts_the_compute_dtype(tiny_checkpoint, tmp_path):
    hf, path = tiny_checkpoint
    n_params = sum(p.numel() for p in hf.parameters())  # untied: lm_head counted once
    assert weights_nbytes(path, torch.float32) == 4 * n_params
    assert weights_nbytes(path, torch.bfloat16) == 2 * n_params
    tensors = {**read_tensors(path), "mtp.fc.weight": torch.ones(64, 128)}
    assert weights_nbytes(write_checkpoint(path, tmp_path / "ckpt", tensors), torch.float32) == 4 * n_params


def test_check_memory_fit_refuses_with_the_numbers():
    gib = 1 << 30
    check_memory_fit(gib, gib // 2, MemoryShare(2 * gib))  # 1.5 GiB of 2 GiB: under 90%
    with pytest.raises(InsufficientMemory) as e:
        check_memory_fit(gib, 15 * gib // 16, MemoryShare(2 * gib))  # 1.94 GiB
    assert isinstance(e.value, MemoryError)
    for part in ("1.00 GiB", "960.0 MiB", "1.94 GiB", "2.00 GiB"):
        assert part in str(e.value)
    check_memory_fit(0, 0)  # reads this machine's MemAvailable
    with pytest.raises(InsufficientMemory):
        check_memory_fit(1 << 60, 0)


def test_a_share_counts_every_copy_of_the_weights_and_every_cache():
    """`serve --replicas 2` with its spare: three processes hold the weights, two fill a cache; the
    room a default cache gets is what fits when every one of them does."""
    gib = 1 << 30
    share = MemoryShare(20 * gib, copies=3, caches=2)
    room = cache_room(4 * gib, share)
    assert room == int(0.5 * (int(0.9 * 20 * gib) - 12 * gib)) // 2  # 1.5 GiB each
    check_memory_fit(4 * gib, room, share)
    assert 3 * 4 * gib + 2 * room <= 0.9 * 20 * gib
    with pytest.raises(InsufficientMemory) as e:
        check_memory_fit(4 * gib, 3 * gib + 1, share)  # 12 GiB + 2 x 3 GiB > 18 GiB
    assert "3 copies of the weights (4.00 GiB each: the replicas and a loaded spare)" in str(e.value)
    assert "2 caches (3.00 GiB each)" in str(e.value)
    with pytest.raises(InsufficientMemory, match=r"2 copies of the weights \(4.00 GiB each: the replicas\)"):
        check_memory_fit(4 * gib, 6 * gib, MemoryShare(20 * gib, copies=2, caches=2))
    assert cache_room(7 * gib, share) == 0  # the weights alone take the limit: nothing left
    alone = MemoryShare(20 * gib)
    assert cache_room(4 * gib, alone) == int(0.5 * (int(0.9 * 20 * gib) - 4 * gib))


def test_a_share_travels_as_one_flag_value_and_refuses_nonsense():
    share = MemoryShare(123456789, 3, 2)
    assert MemoryShare.parse(str(share)) == share
    for bad in ("1,2", "x,1,1", "10,1,2", "10,0,0", "-1,1,1"):
        with pytest.raises(ValueError, match="memory share|available memory"):
            MemoryShare.parse(bad)
    assert MemoryShare().measure().available is not None  # MemAvailable read once, then kept
