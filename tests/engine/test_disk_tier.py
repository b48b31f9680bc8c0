"""The prefix cache's disk tier: what a finished sequence leaves on disk restores, in a fresh
process's `LLM`, to a sequence whose logits equal transformers' own forward; a chat continues
after a restart computing only the new tokens; a RAM budget of two conversations with 20 in
rotation computes what an unlimited one does. Counted exactly through the usage counters."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path
from typing import Any

import torch

from hybridkv import CacheConfig, CachedModel
from hybridkv.engine.disk_store import list_models
from hybridkv.engine.disk_tier import open_disk_tier
from hybridkv.engine.engine import EngineConfig
from hybridkv.engine.llm import LLM
from hybridkv.engine.sampling import SamplingParams
from hybridkv.models.sources import resolve_model

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
SHORT = SamplingParams(max_tokens=2, temperature=0.0)
MB = 1 << 20


def make_llm(
    chat_model: tuple[Path, Any],
    cache_dir: Path | None,
    cached: int | None = None,
    max_sequences: int = 17,
    kv_dtype: torch.dtype | None = None,
) -> LLM:
    cache = CacheConfig(max_sequences=max_sequences, max_model_len=2048, snapshots_per_sequence=16, kv_dtype=kv_dtype)
    engine = EngineConfig(max_num_seqs=8, max_cached_sequences=cached)
    return LLM(chat_model[0], cache=cache, engine=engine, cache_dir=cache_dir, cache_disk=None if cache_dir else 0)


def conversation(k: int, turns: int) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": f"You are assistant number {k}, and terse about it."}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"Conversation {k}, question {t}: what comes next?"})
    return messages


def chat_turns(llm: LLM, k: int, turns: int) -> tuple[list[list[int]], list[int], list[int]]:
    """Run conversation `k` for `turns` turns: generated ids, computed prompt tokens and prompt
    tokens, per turn."""
    messages = conversation(k, 0)
    outputs, computed, prompts = [], [], []
    for t in range(turns):
        messages.append(conversation(k, t + 1)[-1])
        out = llm.chat(messages, GREEDY)
        outputs.append(out.outputs[0].token_ids)
        computed.append(out.usage.computed_tokens)
        prompts.append(out.usage.prompt_tokens)
        messages.append({"role": "assistant", "content": out.text})
        llm.cm.cache.check_integrity()
    return outputs, computed, prompts


def test_a_restored_prefix_gives_transformers_logits(chat_model: tuple[Path, Any], tmp_path: Path) -> None:
    first = make_llm(chat_model, tmp_path)
    messages = conversation(0, 1)
    ids, hints = first.encode_chat(messages)
    out = first.chat(messages, GREEDY)
    first.close()
    assert stat.S_IMODE(os.stat(tmp_path).st_mode) == 0o700
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert files and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files)

    fresh = make_llm(chat_model, tmp_path)
    tokens = ids + out.outputs[0].token_ids[:-1]  # what the finished sequence held
    assert fresh.engine.disk is not None
    full = tokens + fresh.encode("<|im_end|>\nmore")
    for limit in (len(tokens), hints[0] + 1, hints[0] + 5):  # its end, a message end, between restore points
        restored = fresh.engine.disk.restore(full, limit, better_than=0)
        assert restored is not None
        seq, keep = restored
        fresh.cm.cache.check_integrity()
        assert keep == {len(tokens): len(tokens), hints[0] + 1: hints[0] + 1, hints[0] + 5: hints[0] + 1}[limit]
        got = fresh.cm.feed({seq: full[keep:]}, logits="all")[seq]
        with torch.no_grad():
            want = chat_model[1](torch.tensor([full])).logits[0, keep:].float()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert fresh.cm.truncate(seq, keep) == keep  # the restored state is a restore point, as in RAM
        fresh.cm.cache.check_integrity()
        fresh.cm.release(seq)
        fresh.cm.cache.check_integrity()
    fresh.close()


def test_a_chat_continues_after_a_restart_computing_only_the_new_tokens(
    chat_model: tuple[Path, Any], tmp_path: Path
) -> None:
    before = make_llm(chat_model, tmp_path)
    chat_turns(before, 0, 2)
    before.close()
    after = make_llm(chat_model, tmp_path)
    no_disk = make_llm(chat_model, None)
    outputs, computed, prompts = chat_turns(after, 0, 3)
    want_outputs, want_computed, _ = chat_turns(no_disk, 0, 3)
    assert outputs == want_outputs
    # The first two turns repeat what the first process computed: each computes only its last
    # token (for logits); the third only its new tokens, as in one process.
    assert computed == [1, 1, want_computed[2]]
    assert after.engine.metrics()["prompt_tokens_disk"] == prompts[0] - 1 + prompts[1] - 1
    after.close()
    assert list_models(tmp_path)[0]["states"] > 0


def test_a_float16_cache_restores_its_own_blocks_and_never_another_types(
    chat_model: tuple[Path, Any], tmp_path: Path
) -> None:
    """K/V stored in float16 go to disk as they are (half the bytes) and come back bit for bit: the
    chat continues after a restart as it does in one process. A float32 cache of the same model
    is another cache: it never reads the float16 blocks."""
    before = make_llm(chat_model, tmp_path, kv_dtype=torch.float16)
    chat_turns(before, 0, 2)
    before.close()
    after = make_llm(chat_model, tmp_path, kv_dtype=torch.float16)
    no_disk = make_llm(chat_model, None, kv_dtype=torch.float16)
    outputs, computed, _ = chat_turns(after, 0, 3)
    want_outputs, want_computed, _ = chat_turns(no_disk, 0, 3)
    assert outputs == want_outputs and computed == [1, 1, want_computed[2]]
    after.close()
    other = make_llm(chat_model, tmp_path)
    _, computed, prompts = chat_turns(other, 0, 1)
    assert computed == prompts and other.engine.metrics().get("prompt_tokens_disk", 0) == 0
    other.close()
    assert len(list_models(tmp_path)) == 2


def test_two_conversations_of_ram_with_twenty_in_rotation(chat_model: tuple[Path, Any], tmp_path: Path) -> None:
    """Every turn after the first computes as many tokens as with RAM for all twenty: what RAM
    evicts comes back from disk. The same answers, too."""
    conversations = 20
    tight = make_llm(chat_model, tmp_path, cached=2)
    roomy = make_llm(chat_model, None, max_sequences=3 * conversations + 9)  # every turn's entry stays
    assert roomy.engine.index.max_entries >= 3 * conversations
    computed: dict[str, list[list[int]]] = {"tight": [], "roomy": []}
    answers: dict[str, list[list[list[int]]]] = {"tight": [], "roomy": []}
    for name, llm in (("tight", tight), ("roomy", roomy)):
        histories = [conversation(k, 0) for k in range(conversations)]
        for turn in range(3):
            this_round, answered = [], []
            for k in range(conversations):
                histories[k].append(conversation(k, turn + 1)[-1])
                out = llm.chat(histories[k], SHORT)
                histories[k].append({"role": "assistant", "content": out.text})
                this_round.append(out.usage.computed_tokens)
                answered.append(out.outputs[0].token_ids)
            if llm.engine.disk is not None:
                llm.engine.disk.flush()  # writes are asynchronous: a round of 19 others is time enough in use
            computed[name].append(this_round)
            answers[name].append(answered)
            llm.cm.cache.check_integrity()
    assert answers["tight"] == answers["roomy"]
    assert computed["tight"][1:] == computed["roomy"][1:]
    assert max(computed["tight"][2]) < min(computed["tight"][0])  # only the new tokens, really
    assert len(tight.engine.index) == 2 and tight.engine.metrics()["prompt_tokens_disk"] > 0
    tight.close()


def test_memory_pressure_drops_a_pending_write_and_never_waits_for_it(
    chat_model: tuple[Path, Any], tmp_path: Path
) -> None:
    """Blocks wait pinned for the writer; when the cache needs room, the engine unpins them and
    cancels the write instead of waiting: that entry is then simply not on disk."""
    llm = make_llm(chat_model, tmp_path)
    disk = llm.engine.disk
    assert disk is not None
    gate = threading.Event()
    real_write = disk.store.write

    def held_write(name: str, parts: Any) -> bool:
        if name.endswith(".kv"):  # the writer thread's blocks wait; nothing else does
            gate.wait(timeout=60)
        return real_write(name, parts)

    disk.store.write = held_write  # type: ignore[method-assign]
    out = llm.chat(conversation(1, 1), GREEDY)
    cache = llm.cm.cache
    cache.check_integrity()  # pins are counted as references
    held = cache.blocks.num_used
    llm.engine.index.clear()
    assert cache.blocks.num_used > 0  # the pending write still holds its blocks
    while llm.engine._evict_one():  # what the engine does when a forward does not fit
        pass
    assert cache.blocks.num_used == 0 < held
    cache.check_integrity()
    gate.set()
    disk.flush()
    assert not list(tmp_path.glob("*/*.state"))  # at most the block being written when cancelled
    again = llm.chat(conversation(1, 1), GREEDY)
    assert again.outputs[0].token_ids == out.outputs[0].token_ids and again.usage.cached_tokens == 0
    llm.close()


def test_a_gguf_models_prefix_restores_to_a_fresh_recompute(tmp_path: Path) -> None:
    """A quantized GGUF file (keyed by its name, size, metadata and samples): what one disk tier
    wrote, another restores, and the logits after it equal a fresh recompute's."""
    path = Path(__file__).resolve().parents[1] / "data" / "gguf" / "qwen35-tiny-q8_0.gguf"
    source = resolve_model(path)
    cm = CachedModel.load(source, cache=CacheConfig(max_sequences=3, max_model_len=128, snapshot_interval=16))
    ids = torch.randint(0, cm.vocab_size, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    writer = open_disk_tier(source, cm, None, tmp_path)
    assert writer is not None
    seq = cm.new_sequence()
    cm.feed({seq: ids[:50]}, logits="none", snapshot_at={seq: [40]})
    writer.save(seq)
    writer.close()
    cm.release(seq)
    reader = open_disk_tier(source, cm, None, tmp_path)
    assert reader is not None
    for limit, want_keep in ((69, 50), (45, 41)):  # the live state at 50, the snapshot after token 40
        restored = reader.restore(ids, limit, better_than=0)
        assert restored is not None and restored[1] == want_keep
        got = cm.feed({restored[0]: ids[want_keep:]}, logits="all")[restored[0]]
        cm.release(restored[0])
        fresh = cm.new_sequence()
        want = cm.feed({fresh: ids}, logits="all")[fresh][want_keep:]
        cm.release(fresh)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        cm.cache.check_integrity()
    reader.close()
