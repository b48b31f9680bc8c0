"""The multi-token-prediction block: loaded from every checkpoint layout that ships one, its
cached drafts equal a plain no-cache PyTorch twin (`mtp_reference`) over transformers' hidden
states, and with MTP off nothing changes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hf_reference import hf_logits, make_hf_model, max_rel_err, save_checkpoint
from mtp_reference import add_mtp, mtp_tensors, twin_draft
from qwen35_reference import make_qwen35, qwen35_logits, save_qwen35

from hybridkv import CacheConfig, CachedModel
from hybridkv.cached_model import cache_spec
from hybridkv.errors import NotSupported
from hybridkv.models import ModelConfig, load_model, weights_nbytes
from hybridkv.ops import native

TOL = 1e-4
DATA = Path(__file__).parents[1] / "data"
CACHE_FIELDS: dict[str, Any] = dict(max_model_len=64, block_size=4, max_sequences=4, snapshot_interval=5)
CACHE = CacheConfig(**CACHE_FIELDS)

# name: (make the transformers model, is the MTP layer MoE, fused MTP experts)
LAYOUTS: dict[str, tuple[Any, bool, bool]] = {
    "qwen3_next": (lambda: make_hf_model(seed=3, full_attention_interval=2), True, False),
    "qwen3_5_vlm_dense": (lambda: make_qwen35(seed=3, tie=True), False, False),
    "qwen3_5_vlm_moe_per_expert": (lambda: make_qwen35(moe=True, seed=3), True, False),
    "qwen3_5_text_moe_fused": (lambda: make_qwen35(moe=True, vlm=False, seed=3), True, True),
    "qwen3_5_text_dense": (lambda: make_qwen35(vlm=False, seed=3), False, False),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Any:
    made: dict[str, tuple[Any, Path, dict[str, torch.Tensor], bool]] = {}

    def get(name: str) -> tuple[Any, Path, dict[str, torch.Tensor], bool]:
        if name not in made:
            make, moe, fused = LAYOUTS[name]
            hf = make()
            path = tmp_path_factory.mktemp(name)
            if name == "qwen3_next":
                save_checkpoint(hf, path)
            else:
                save_qwen35(hf, path, mtp=False)
            tensors = mtp_tensors(hf.config.get_text_config(), seed=5, moe=moe, fused_experts=fused)
            made[name] = (hf, add_mtp(path, tensors), tensors, moe)
        return made[name]

    return get


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", LAYOUTS)
def test_cached_drafts_equal_the_twin_and_main_logits_stay_exact(checkpoints: Any, name: str) -> None:
    hf, path, tensors, moe = checkpoints(name)
    cm = CachedModel.load(path, cache=CACHE, mtp=True)
    ids = tokens(14, seed=1)
    a, b = cm.new_sequence(), cm.new_sequence()
    first = cm.feed({a: ids[:6], b: ids[:3]})  # prefill chunks of different lengths in one batch
    second = cm.feed({a: ids[6:7], b: ids[3:11]})  # a decode step beside a prefill chunk
    main_logits = hf_logits if name == "qwen3_next" else qwen35_logits
    assert max_rel_err(torch.cat([first[a], second[a]]), main_logits(hf, ids[:7])) <= TOL
    drafts = cm.draft_mtp_logits({a: ids[7], b: ids[11]}, 3)
    assert max_rel_err(drafts[a], twin_draft(tensors, hf, moe, ids[:7], ids[7], 3)) <= TOL
    assert max_rel_err(drafts[b], twin_draft(tensors, hf, moe, ids[:11], ids[11], 3)) <= TOL
    cm.cache.check_integrity()


@pytest.mark.parametrize("use_native", [True, False])
def test_both_draft_paths_equal_the_twin_across_block_boundaries(
    checkpoints: Any, monkeypatch: pytest.MonkeyPatch, use_native: bool
) -> None:
    """The C++ draft step (a private copy of the MTP K/V) and the eager one (N > FEW_ROWS, or no
    kernels): histories of 1, 4 and 9 tokens cross 0, 1 and 2 blocks of 4."""
    monkeypatch.setattr(native, "disabled", not use_native)
    hf, path, tensors, moe = checkpoints("qwen3_5_vlm_moe_per_expert")
    cm = CachedModel.load(path, cache=CACHE, mtp=True)
    ids = tokens(12, seed=4)
    lengths = (1, 4, 9)
    seqs = [cm.new_sequence() for _ in lengths]
    cm.feed({s: ids[:n] for s, n in zip(seqs, lengths, strict=True)}, "none")
    drafts = cm.draft_mtp_logits({s: ids[n] for s, n in zip(seqs, lengths, strict=True)}, 3)
    for s, n in zip(seqs, lengths, strict=True):
        assert max_rel_err(drafts[s], twin_draft(tensors, hf, moe, ids[:n], ids[n], 3)) <= TOL
    cm.cache.check_integrity()


def test_pre_norm_hidden_feeds_the_block_when_asked(checkpoints: Any) -> None:
    hf, path, tensors, moe = checkpoints("qwen3_next")
    cm = CachedModel.load(path, cache=CACHE, mtp=True, mtp_hidden="pre_norm")
    ids = tokens(9, seed=2)
    seq = cm.new_sequence()
    cm.feed({seq: ids[:8]})
    got = cm.draft_mtp_logits({seq: ids[8]}, 2)[seq]
    assert max_rel_err(got, twin_draft(tensors, hf, moe, ids[:8], ids[8], 2, hidden="pre_norm")) <= TOL
    post = twin_draft(tensors, hf, moe, ids[:8], ids[8], 2)
    assert max_rel_err(got, post) > 1e-2  # the switch changes what the block sees


def test_drafting_changes_nothing_in_the_cache(checkpoints: Any) -> None:
    hf, path, _, _ = checkpoints("qwen3_next")
    cm = CachedModel.load(path, cache=CACHE, mtp=True)
    ids = tokens(12, seed=3)
    seq = cm.new_sequence()
    cm.feed({seq: ids[:10]})
    before = [t.clone() for t in (*cm.cache.tensors.key, *cm.cache.tensors.live_states())]
    first = cm.draft_mtp({seq: ids[10]}, 4)
    assert cm.draft_mtp({seq: ids[10]}, 4) == first
    after = [*cm.cache.tensors.key, *cm.cache.tensors.live_states()]
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    cm.cache.check_integrity()
    assert max_rel_err(cm.feed({seq: ids[10:]})[seq], hf_logits(hf, ids)[10:]) <= TOL


def test_bad_draft_requests_are_refused_with_what_to_fix(checkpoints: Any) -> None:
    _, path, _, _ = checkpoints("qwen3_next")
    cm = CachedModel.load(path, cache=CACHE, mtp=True)
    seq, empty = cm.new_sequence(), cm.new_sequence()
    cm.feed({seq: tokens(5, seed=4)})
    with pytest.raises(ValueError, match="k .* must be an int >= 1"):
        cm.draft_mtp({seq: 1}, 0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        cm.draft_mtp({seq: 128}, 2)
    with pytest.raises(ValueError, match="unknown sequence"):
        cm.draft_mtp({99: 1}, 2)
    with pytest.raises(ValueError, match="is empty"):
        cm.draft_mtp({seq: 1, empty: 1}, 2)
    cm.cache.check_integrity()
    assert len(cm.draft_mtp({seq: 1}, 2)[seq]) == 2
    plain = CachedModel.load(path, cache=CACHE)
    other = plain.new_sequence()
    plain.feed({other: [1, 2]})
    with pytest.raises(NotSupported, match="mtp=True"):
        plain.draft_mtp({other: 3}, 2)


def test_mtp_off_keeps_the_cache_and_weights_as_they_were(checkpoints: Any) -> None:
    _, path, _, _ = checkpoints("qwen3_5_vlm_moe_per_expert")
    config = ModelConfig.from_dir(path)
    assert config.mtp_num_hidden_layers == 1
    off, on = cache_spec(config, torch.float32), cache_spec(config, torch.float32, mtp=True)
    assert off.hidden_carry_dim == 0 and on.hidden_carry_dim == config.hidden_size
    assert on.num_attention_layers == off.num_attention_layers + 1
    plain = CachedModel.load(path, cache=CACHE)
    assert plain.model.mtp is None and plain.cache.tensors.hidden == []
    assert len(plain.cache.tensors.key) == len(config.attention_layers)
    mtp_bytes = sum(p.nbytes for n, p in load_model(path, mtp="post_norm").named_parameters() if n.startswith("mtp."))
    assert weights_nbytes(path, torch.float32, mtp=True) == weights_nbytes(path, torch.float32) + mtp_bytes


def test_mtp_is_refused_where_there_is_none(checkpoints: Any, tmp_path: Path) -> None:
    plain = save_checkpoint(make_hf_model(seed=1), tmp_path)
    with pytest.raises(NotSupported, match="no multi-token-prediction block"):
        CachedModel.load(plain, cache=CACHE, mtp=True)
    with pytest.raises(NotSupported, match="GGUF"):
        load_model(DATA / "gguf" / "qwen35moe-tiny-q8_0.gguf", mtp="post_norm")


def test_a_restored_snapshot_brings_its_hidden_carry(checkpoints: Any) -> None:
    """Forking or truncating exactly to a snapshot re-feeds nothing: the draft after it can only
    be right if the snapshot kept the hidden state beside the recurrent state."""
    hf, path, tensors, moe = checkpoints("qwen3_next")
    cm = CachedModel.load(path, cache=CACHE, mtp=True)
    ids = tokens(17, seed=7)
    seq = cm.new_sequence()
    cm.feed({seq: ids[:13]})
    child = cm.fork(seq, 10)
    assert cm.truncate(seq, 5) == 5 and cm.stats()["tokens_recomputed"] == 0
    for s, length in ((child, 10), (seq, 5)):
        got = cm.draft_mtp_logits({s: ids[length]}, 3)[s]
        assert max_rel_err(got, twin_draft(tensors, hf, moe, ids[:length], ids[length], 3)) <= TOL
        cm.cache.check_integrity()


def test_after_a_verify_the_accepted_row_brings_its_hidden_carry(checkpoints: Any) -> None:
    """A verify forward feeds [token, drafts...]; accepting a prefix loads the hidden state of the
    last kept position from its verify row, and the MTP K/V past it is dropped with the rest."""
    hf, path, tensors, moe = checkpoints("qwen3_next")
    cm = CachedModel.load(path, cache=CacheConfig(**{**CACHE_FIELDS, "verify_rows": 6}), mtp=True)
    ids, wrong = tokens(12, seed=8), tokens(4, seed=9)
    seq = cm.new_sequence()
    cm.feed({seq: ids[:6]})
    cm.feed({seq: [ids[6], ids[7], *wrong]}, verify=[seq])
    with pytest.raises(ValueError, match="accept"):
        cm.draft_mtp({seq: 1}, 2)
    cm.accept(seq, 8)  # ids[6] and the draft ids[7] kept, the wrong drafts rejected
    cm.cache.check_integrity()
    got = cm.draft_mtp_logits({seq: ids[8]}, 3)[seq]
    assert max_rel_err(got, twin_draft(tensors, hf, moe, ids[:8], ids[8], 3)) <= TOL
    cm.feed({seq: ids[8:11]})  # the MTP K/V of the rejected slots is rewritten
    got = cm.draft_mtp_logits({seq: ids[11]}, 3)[seq]
    assert max_rel_err(got, twin_draft(tensors, hf, moe, ids[:11], ids[11], 3)) <= TOL


def test_bfloat16_weights_draft_within_bfloat16_error(checkpoints: Any) -> None:
    """bf16 compute with float32 carry: drafts stay within the parity tests' bf16 bounds of the
    float32 twin, through a prefill, a decode step and a snapshot restore."""
    hf, path, tensors, moe = checkpoints("qwen3_next")
    cm = CachedModel.load(path, dtype=torch.bfloat16, cache=CACHE, mtp=True)
    ids = tokens(13, seed=10)
    seq = cm.new_sequence()
    cm.feed({seq: ids[:11]})
    cm.feed({seq: ids[11:12]})
    cm.truncate(seq, 10)
    got = cm.draft_mtp_logits({seq: ids[10]}, 2)[seq]
    want = twin_draft(tensors, hf, moe, ids[:10], ids[10], 2)
    scale = want.abs().max()
    assert (got - want).abs().mean() <= 2e-2 * scale and (got - want).abs().max() <= 1e-1 * scale
