"""`chat_turn8_after_restart_ttft`: the synthetic chat's eighth turn restored from a disk tier
that another one wrote on the same directory (the first seven turns), against computing the
whole prompt again, which is what a restart without a disk tier costs.

As after a restart, RAM holds nothing of the chat: the writer's sequence is released and the
reading tier is a new one, whose store lists the directory afresh (the weights are not loaded a
second time: they are not what a restart of the cache changes). Cold: the cache files' pages are
dropped (`posix_fadvise(DONTNEED)`) before each repetition, so they come from the disk as after a
reboot; warm: they are in the page cache, as after a restart of the process alone. Each
repetition restores from disk and computes the rest of the prompt with its logits.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from hybridkv.bench.scenarios import Bench, Result, _timed
from hybridkv.bench.workload import Chat
from hybridkv.engine.disk_tier import open_disk_tier
from hybridkv.models.sources import resolve_model

NAME = "chat_turn8_after_restart_ttft"


def chat_after_restart(
    b: Bench, model_dir: Path, dtype: torch.dtype, quantize: str | None, target: float | None
) -> list[Result]:
    conv = Chat.build(b.plan.chat, b.vocab)
    turn_start = conv.turn_starts[-1]  # the history: seven turns, replies included
    prompt = conv.tokens[: conv.reply_starts[-1]]  # the eighth turn's prompt
    cm, source = b.cm, resolve_model(model_dir)
    with tempfile.TemporaryDirectory(prefix="hybridkv-bench-disk-") as cache_dir, torch.inference_mode():
        b.log(f"  {NAME}: {turn_start} tokens of history written to disk, read back by a new disk tier")
        writer = open_disk_tier(source, cm, quantize, cache_dir)
        assert writer is not None
        seq = cm.new_sequence()
        cm.feed({seq: conv.tokens[:turn_start]}, logits="none", snapshot_at={seq: conv.boundaries_in(0, turn_start)})
        writer.save(seq)
        writer.close()  # flushed: every block and state is on disk
        cm.release(seq)
        disk = open_disk_tier(source, cm, quantize, cache_dir)
        assert disk is not None
        restored: list[int] = []

        def after_restart(cold: bool) -> float:
            if cold:
                disk.store.drop_page_cache()

            def turn() -> None:
                found = disk.restore(prompt, len(prompt) - 1, better_than=0)
                if found is None:
                    raise RuntimeError("the history written to disk was not found")
                seq, keep = found
                restored.append(keep)
                cm.feed({seq: prompt[keep:]}, logits="last")
                cm.release(seq)

            return _timed(turn)

        def recompute() -> float:
            def turn() -> None:
                seq = cm.new_sequence()
                cm.feed({seq: prompt}, logits="last")
                cm.release(seq)

            return _timed(turn)

        cold = b.alternate(lambda: after_restart(True), recompute)
        warm = b.alternate(lambda: after_restart(False), recompute)
        disk_bytes = disk.store.bytes_used
        disk.close()
    notes = {
        "prompt_tokens": len(prompt),
        "restored_tokens": restored[-1],
        "disk_bytes": disk_bytes,
        "recompute_tokens": len(prompt),
    }
    return [
        Result(NAME, 1e3 * cold[0], 1e3 * cold[1], "ms", target, None, notes, baseline="full recompute"),
        Result(f"{NAME}_warm", 1e3 * warm[0], 1e3 * warm[1], "ms", None, None, notes, baseline="full recompute"),
    ]
