"""`hybridkv bench` on a tiny model: the document it writes and what its figures mean (no timings)."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from hybridkv import CachedModel, bench, cli
from hybridkv.bench.machine import Limits
from hybridkv.bench.profile import op_families, part_times
from hybridkv.bench.report import print_table, write_json
from hybridkv.bench.workload import BENCH_MODEL, Chat, ChatLayout, Plan, build_checkpoint
from hybridkv.ops import native

SCENARIOS = [
    "prefill_512",
    "prefill_2048",
    "decode_b1",
    "decode_b16",
    "chat_turn8_ttft",
    "regenerate_ttft",
    "edit_last_message_ttft",
    "fork_n8",
]
TINY_MODEL = {
    **BENCH_MODEL,
    "vocab_size": 128,
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "intermediate_size": 32,
}
TINY_CHAT = ChatLayout(system=6, user=14, header=3, reply=5, turns=3, edited=4)
TINY_PLAN = Plan(
    prefill_lens=(24, 40),
    decode_prompt=12,
    decode_steps=2,
    batch=4,
    peer_batch=2,
    chat=TINY_CHAT,
    fork_prompt=20,
    forks=3,
    reps=1,
    warmup=0,
)
LIMITS = Limits(threads=2, read_gb_s=30.0, matmul_gflop_s=100.0)  # fixed: no time spent measuring


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("bench") / "model", TINY_MODEL)


@pytest.fixture(scope="module")
def document(tiny_dir: Path) -> dict[str, Any]:
    return bench.run(tiny_dir, torch.float32, TINY_PLAN, log=lambda line: None, limits=LIMITS)


def test_every_scenario_reports_both_engines_a_unit_and_a_ratio(document):
    assert list(document["scenarios"]) == SCENARIOS
    for name, s in document["scenarios"].items():
        assert s["hybridkv"] > 0 and s["transformers"] > 0, name
        assert s["unit"] in ("tok/s", "ms/token", "ms"), name
        assert s["ratio"] > 0, name
    assert json.loads(json.dumps(document)) == document  # plain JSON all the way down


def test_ratio_above_one_always_means_hybridkv_is_better(document):
    for name, s in document["scenarios"].items():
        if s["unit"] == "tok/s":  # a rate: more is better
            assert s["better"] == "higher"
            assert s["ratio"] == pytest.approx(s["hybridkv"] / s["transformers"]), name
        else:  # a time: less is better
            assert s["better"] == "lower"
            assert s["ratio"] == pytest.approx(s["transformers"] / s["hybridkv"]), name


def test_decode_b16_says_which_batch_each_engine_ran(document):
    d = document["scenarios"]["decode_b16"]
    assert (d["hybridkv_batch"], d["transformers_batch"]) == (TINY_PLAN.batch, TINY_PLAN.peer_batch)
    assert document["scenarios"]["decode_b1"]["unit"] == "ms/token"


def test_regenerate_and_edit_reuse_the_conversation_while_transformers_recomputes_it(document):
    s = document["scenarios"]
    prompt = TINY_CHAT.prompt_len(TINY_CHAT.turns)
    assert s["regenerate_ttft"]["hybridkv_tokens_computed"] == TINY_CHAT.header
    assert s["edit_last_message_ttft"]["hybridkv_tokens_computed"] == TINY_CHAT.user + TINY_CHAT.header
    for name in ("regenerate_ttft", "edit_last_message_ttft"):
        assert s[name]["transformers_tokens_computed"] == prompt


def test_forks_share_the_prompt_until_they_write(document):
    f = document["scenarios"]["fork_n8"]
    assert f["hybridkv_extra_bytes"] == 0
    assert 0 < f["hybridkv_extra_bytes_after_first_token"] < f["transformers_extra_bytes"]


def test_both_engines_run_the_same_weights(document):
    assert document["scenarios"]["prefill_512"]["max_rel_err"] < 1e-4


def test_limits_are_reported_with_the_fraction_reached(document):
    assert document["machine"]["memory_read_gb_s"] == LIMITS.read_gb_s
    for name in ("prefill_512", "decode_b1", "decode_b16"):
        s = document["scenarios"][name]
        assert s["limit"] > 0 and s["hybridkv_limit_fraction"] > 0, name
    assert document["scenarios"]["chat_turn8_ttft"]["limit"] is None


def test_table_and_json_file(document, tmp_path):
    out = io.StringIO()
    print_table(document, Console(file=out, width=200))
    text = out.getvalue()
    for name in SCENARIOS:
        assert name in text
    assert "memory read 30.0 GB/s" in text
    path = tmp_path / "bench.json"
    write_json(document, path)
    assert json.loads(path.read_text())["scenarios"].keys() == document["scenarios"].keys()


def test_the_synthetic_chat_has_the_documented_layout():
    layout = ChatLayout()
    assert layout.prompt_len(8) == 1248
    chat = Chat.build(layout, vocab_size=32000)
    assert chat.reply_starts[-1] == 1248
    assert len(chat.tokens) == 1248 + layout.reply
    assert chat.boundaries[:3] == [71, 71 + 53, 71 + 53 + 3 + 104]
    edited = chat.edited_last_user(32000)
    original = chat.tokens[chat.turn_starts[-1] : chat.turn_starts[-1] + layout.user]
    assert len(edited) == layout.user
    assert sum(a != b for a, b in zip(edited, original, strict=True)) == layout.edited
    assert edited[-2:] == original[-2:]  # the closing tokens of the message are kept


def test_without_transformers_the_command_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    assert cli.main(["bench", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "transformers" in err and "pip install" in err


def test_a_missing_model_directory_is_a_usage_error(tmp_path, capsys):
    assert cli.main(["bench", "--model", str(tmp_path / "nowhere")]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_decode_profile_names_every_part_and_op_family(tiny_dir):
    cm = CachedModel.load(tiny_dir)
    seq = cm.new_sequence()
    cm.feed({seq: [1, 2, 3]}, logits="last")

    def step() -> None:
        cm.feed({seq: [4]}, logits="last")

    parts = part_times(cm, step, steps=2)
    assert {"SparseMoE x4", "GatedDeltaNet x3", "GatedAttention x1", "layer RMSNorms x8"} <= parts.keys()
    assert all(ms >= 0 for ms in parts.values())
    families = op_families(step, steps=2)
    assert families["weight matmuls (rows_matmul, mm, bmm)"] > 0
    if native.kernels() is not None:  # a decode step is four C++ kernels and the projections
        assert families["MoE block (C++ moe_block)"] > 0
        assert families["linear-attention step (C++)"] > 0
        assert families["attention step (C++)"] > 0


@pytest.mark.slow
def test_cli_quick_run_on_a_tiny_checkpoint_writes_json(tmp_path: Path, capsys):
    model_dir = build_checkpoint(tmp_path / "model", TINY_MODEL)
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--model", str(model_dir), "--quick", "--json", str(out)]) == 0
    assert list(json.loads(out.read_text())["scenarios"]) == SCENARIOS
    assert "decode_b16" in capsys.readouterr().out
