"""`hybridkv bench` on tiny models: the document it writes, what its figures mean, and the named
shapes it builds (their configs only: a 0.8B checkpoint is never built here; no timings)."""

from __future__ import annotations

import io
import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from hybridkv import CachedModel, bench, cli
from hybridkv.bench.machine import Limits, WeightCounts
from hybridkv.bench.profile import op_families, part_times
from hybridkv.bench.report import print_table, write_json
from hybridkv.bench.workload import (
    BENCH_MODEL,
    QUICK,
    SHAPES,
    Chat,
    ChatLayout,
    Plan,
    Shape,
    build_checkpoint,
    cached_checkpoint,
)
from hybridkv.models import ModelConfig
from hybridkv.ops import native
from hybridkv.ops.quant.stream import last_level_cache_bytes


def scenario_names(spec_methods: tuple[str, ...] = ("ngram", "mtp", "auto"), verify_k: int = 8) -> list[str]:
    """Every scenario a run reports, in order, for the drafts it measures and the widths verify_w* times."""
    return [
        *BASE_SCENARIOS[:10],
        *(f"{s}/{m}" for s in ("spec_code_edit_b1", "spec_free_text_b1", "spec_code_edit_b8") for m in spec_methods),
        *(f"verify_w{w}" for w in range(1, verify_k + 2) if spec_methods),
        *BASE_SCENARIOS[10:],
    ]


BASE_SCENARIOS = [
    "prefill_512",
    "prefill_2048",
    "decode_b1",
    "decode_b16",
    "chat_turn8_ttft",
    "regenerate_ttft",
    "edit_last_message_ttft",
    "fork_n8",
    "json_schema_b1",
    "json_schema_b8",
    "chat_turn8_after_restart_ttft",
    "chat_turn8_after_restart_ttft_warm",
]
SCENARIOS = scenario_names()
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
TINY_QWEN3_5 = {  # the 0.8B's structure (tied head, dense SwiGLU, 3:1 layers), tiny
    "vocab_size": 128,
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "intermediate_size": 48,
    "tie_word_embeddings": True,
}
TINY_SHAPES = {
    "qwen3_next": Shape("tiny-next", "qwen3_next", TINY_MODEL, "tiny Qwen3-Next"),
    "qwen3_5_text": Shape("tiny-3.5", "qwen3_5_text", TINY_QWEN3_5, "tiny Qwen3.5, tied"),
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
    return build_checkpoint(tmp_path_factory.mktemp("bench") / "model", TINY_SHAPES["qwen3_next"])


@pytest.fixture(scope="module", params=list(TINY_SHAPES))
def document(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The whole bench on a tiny model of each family, built as the named shapes are."""
    shape = TINY_SHAPES[request.param]
    # One family built in a temporary directory (the default), the other in a cache directory.
    cache = tmp_path_factory.mktemp("bench-cache") if request.param == "qwen3_5_text" else None
    # ... and one with every draft at its default k, the other with `--speculative ngram --num-speculative-tokens 2`.
    plan = TINY_PLAN.replace(spec_methods=("ngram",), spec_k=2) if cache else TINY_PLAN
    return bench.run(None, torch.float32, plan, log=lambda line: None, shape=shape, limits=LIMITS, cache_dir=cache)


def test_every_scenario_reports_both_engines_a_unit_and_a_ratio(document):
    ran = document["run"]["plan"]
    methods = ["ngram", "mtp", "auto"] if ran["spec_k"] is None else ["ngram"]
    assert ran["spec_methods"] == methods
    # verify_w* up to the largest k measured: ngram's and auto's default 16, or the k given
    assert ran["verify_k"] == (16 if ran["spec_k"] is None else ran["spec_k"])
    assert list(document["scenarios"]) == scenario_names(tuple(methods), ran["verify_k"])
    ks = {m: document["scenarios"][f"spec_code_edit_b1/{m}"]["k"] for m in methods}
    assert ks == ({"ngram": 16, "mtp": 4, "auto": 16} if ran["spec_k"] is None else {"ngram": ran["spec_k"]})
    for name, s in document["scenarios"].items():
        assert s["hybridkv"] > 0 and s["transformers"] > 0, name
        assert s["unit"] in ("tok/s", "ms/token", "ms", "ms/step"), name
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


def test_after_a_restart_the_history_comes_from_the_disk_tier(document):
    s = document["scenarios"]
    prompt = TINY_CHAT.prompt_len(TINY_CHAT.turns)
    for name in ("chat_turn8_after_restart_ttft", "chat_turn8_after_restart_ttft_warm"):
        assert s[name]["baseline"] == "full recompute" and s[name]["prompt_tokens"] == prompt
        assert s[name]["restored_tokens"] == prompt - TINY_CHAT.user - TINY_CHAT.header  # the whole history
        assert s[name]["disk_bytes"] > 0
    assert s["chat_turn8_after_restart_ttft"]["target_ratio"] == 5.0


def test_forks_share_the_prompt_until_they_write(document):
    f = document["scenarios"]["fork_n8"]
    assert f["hybridkv_extra_bytes"] == 0
    assert 0 < f["hybridkv_extra_bytes_after_first_token"] < f["transformers_extra_bytes"]


def test_structured_output_is_timed_against_the_same_requests_decoding_freely(document):
    s = document["scenarios"]
    for batch in (1, 8):
        x = s[f"json_schema_b{batch}"]
        assert (x["unit"], x["baseline"], x["batch"]) == ("ms/token", "hybridkv free", batch)
        assert x["decode_steps"] == TINY_PLAN.reps * TINY_PLAN.decode_steps  # whole-batch steps only
        assert x["grammar_compile_ms"] > 0 and 0 < x["mask_ms_per_step"] < x["step_ms"]
    assert s["json_schema_b8"]["target_ratio"] == pytest.approx(1 / 1.1)  # at most 10% slower per token
    assert s["decode_b1"]["baseline"] == "transformers"


def test_both_engines_run_the_same_weights(document):
    assert document["scenarios"]["prefill_512"]["max_rel_err"] < 1e-4


def test_transformers_loads_the_checkpoint_by_its_config(document):
    expected = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM"}
    assert document["run"]["transformers_class"] == expected[document["run"]["model_type"]]


def test_limits_are_reported_with_the_fraction_reached(document):
    assert document["machine"]["memory_read_gb_s"] == LIMITS.read_gb_s
    for name in ("prefill_512", "decode_b1", "decode_b16"):
        s = document["scenarios"][name]
        assert s["limit"] > 0 and s["hybridkv_limit_fraction"] > 0, name
    assert document["scenarios"]["chat_turn8_ttft"]["limit"] is None


def test_the_read_probe_outgrows_the_last_level_cache(tmp_path):
    for index, size in (("index0", "48K"), ("index2", "2048K"), ("index3", "300M")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    (tmp_path / "index1").mkdir()  # no size file: skipped
    assert last_level_cache_bytes(tmp_path) == 300 * 2**20
    assert last_level_cache_bytes(tmp_path / "absent") == 0


def test_table_and_json_file(document, tmp_path):
    out = io.StringIO()
    print_table(document, Console(file=out, width=200))
    text = out.getvalue()
    for name in document["scenarios"]:
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


def test_bench_speculation_flags(capsys):
    assert cli.main(["bench", "--num-speculative-tokens", "0", "--quick"]) == 2
    assert "--num-speculative-tokens must be an int in 1..16" in capsys.readouterr().err
    args = cli._parser().parse_args(["bench", "--speculative", "off"])
    assert bench._speculation(args) == {"spec_methods": (), "spec_k": None}
    args = cli._parser().parse_args(["bench", "--speculative", "mtp", "--num-speculative-tokens", "3"])
    assert bench._speculation(args) == {"spec_methods": ("mtp",), "spec_k": 3}


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
    assert families["weight matmuls (rows_matmul[_t], mm, bmm)"] > 0
    if native.kernels() is not None:  # a decode step is four C++ kernels and the projections
        assert families["MoE block (C++ moe_block)"] > 0
        assert families["linear-attention step (C++)"] > 0
        assert families["attention step (C++)"] > 0


@pytest.mark.slow
def test_cli_quick_run_on_a_tiny_checkpoint_writes_json(tmp_path: Path, capsys):
    model_dir = build_checkpoint(tmp_path / "model", TINY_SHAPES["qwen3_5_text"])
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", str(model_dir), "--quick", "--kv-dtype", "float16", "--json", str(out)]
    assert cli.main(argv) == 0
    document = json.loads(out.read_text())
    assert list(document["scenarios"]) == SCENARIOS and document["run"]["kv_dtype"] == "float16"
    assert "decode_b16" in capsys.readouterr().out


# -- the named shapes: each dimension as documented, and as transformers and hybridkv read it ----------


def test_the_default_shape_is_issue_6s_model():
    assert SHAPES["qwen3-next-bench"].config == BENCH_MODEL
    assert list(SHAPES) == ["qwen3-next-bench", "qwen3.5-0.8b", "qwen3.5-moe-mini"]


def test_qwen3_5_0_8b_has_the_real_dimensions():
    c = SHAPES["qwen3.5-0.8b"].model_config()
    assert (c.family, c.num_hidden_layers, c.hidden_size, c.vocab_size) == ("qwen3_5", 24, 1024, 248320)
    assert c.tie_word_embeddings
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (8, 2, 256)
    assert (c.rotary_dim, c.rope_theta) == (64, 1e7)
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim) == (
        16,
        16,
        128,
        128,
    )
    assert c.linear_conv_kernel_dim == 4
    assert (c.num_experts, c.intermediate_size) == (0, 3584)
    assert c.layer_kinds == ("linear", "linear", "linear", "attention") * 6


def test_qwen3_5_moe_mini_has_the_35b_a3b_layer_dimensions():
    c = SHAPES["qwen3.5-moe-mini"].model_config()
    assert (c.family, c.num_hidden_layers, c.hidden_size, c.vocab_size) == ("qwen3_5", 8, 2048, 248320)
    assert not c.tie_word_embeddings
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rotary_dim) == (16, 2, 256, 64)
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim) == (16, 32, 128)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (64, 8, 512)
    assert c.shared_expert_intermediate_size == 512
    assert all(c.moe_layers) and c.norm_topk_prob
    assert c.layer_kinds == ("linear", "linear", "linear", "attention") * 2


@pytest.mark.parametrize("name", list(SHAPES))
def test_each_shape_reads_the_same_in_transformers_and_hybridkv(name: str):
    shape = SHAPES[name]
    hf = shape.hf_config()
    expected_class = {
        "qwen3_next": "Qwen3NextConfig",
        "qwen3_5_text": "Qwen3_5TextConfig",
        "qwen3_5_moe_text": "Qwen3_5MoeTextConfig",
    }[shape.model_type]
    assert type(hf).__name__ == expected_class
    # What transformers writes to config.json is what hybridkv parses.
    assert ModelConfig.from_dict(hf.to_dict()) == shape.model_config()
    assert hf.hidden_size == shape.model_config().hidden_size
    assert hf.tie_word_embeddings == shape.model_config().tie_word_embeddings


@pytest.mark.parametrize(("name", "millions"), [("qwen3.5-0.8b", 752), ("qwen3.5-moe-mini", 2911)])
def test_shape_parameter_counts(name: str, millions: int):
    assert round(SHAPES[name].parameters() / 1e6) == millions  # from a meta-device model: nothing allocated


def test_a_shape_that_does_not_fit_twice_is_refused_before_it_is_built(monkeypatch, capsys):
    monkeypatch.setattr("hybridkv.models.weights.available_memory", lambda: 16 << 30)
    assert cli.main(["bench", "--shape", "qwen3.5-moe-mini"]) == 2  # 2 x 11.6 GB of float32 weights
    err = capsys.readouterr().err
    assert "hybridkv and transformers each hold the weights" in err and "--dtype bfloat16" in err


def test_the_cache_dir_keeps_a_built_checkpoint_for_the_next_run(tmp_path: Path):
    lines: list[str] = []
    first = cached_checkpoint(TINY_SHAPES["qwen3_5_text"], torch.float32, tmp_path, log=lines.append)
    again = cached_checkpoint(TINY_SHAPES["qwen3_5_text"], torch.float32, tmp_path, log=lines.append)
    assert first == again and (first / "config.json").is_file()
    assert lines[0].startswith("building") and lines[1].startswith("using")
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no partial build left behind


def test_shape_and_model_are_exclusive(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--shape", "qwen3.5-0.8b", "--model", str(tmp_path)])
    assert "not allowed with" in capsys.readouterr().err


GGUF_K = Path(__file__).parent / "data" / "gguf" / "qwen35moe-k-q4_k_m.gguf"


def test_the_llama_cpp_peer_runs_a_gguf_file(tmp_path, capsys):
    assert cli.main(["bench", "--peer", "llama.cpp", "--model", str(tmp_path)]) == 2
    assert "--model FILE.gguf" in capsys.readouterr().err


def test_without_llama_cpp_python_the_peer_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    assert cli.main(["bench", "--peer", "llama.cpp", "--model", str(GGUF_K), "--quick"]) == 2
    assert "pip install 'hybridkv[peers]'" in capsys.readouterr().err


def test_a_llama_cpp_with_its_amx_kernels_is_refused_with_the_build_that_runs(monkeypatch, capsys):
    """llama.cpp's AMX kernels segfault on these models' prompts: the bench says so before loading."""
    fake = types.ModuleType("llama_cpp")
    fake.llama_print_system_info = lambda: b"CPU : AVX512 = 1 | AVX512_VNNI = 1 | AMX_INT8 = 1 | OPENMP = 1 |"  # type: ignore[attr-defined]
    logger = types.ModuleType("llama_cpp._logger")
    logger.set_verbose = lambda verbose: None  # type: ignore[attr-defined]
    internals = types.ModuleType("llama_cpp._internals")
    fake._internals = internals  # type: ignore[attr-defined]
    for name, module in {"llama_cpp": fake, "llama_cpp._internals": internals, "llama_cpp._logger": logger}.items():
        monkeypatch.setitem(sys.modules, name, module)
    assert cli.main(["bench", "--peer", "llama.cpp", "--model", str(GGUF_K), "--quick"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "AMX kernels" in err and "-DGGML_NATIVE=OFF" in err and "-DGGML_AMX" not in err


def test_against_llama_cpp_on_the_same_file():
    """Runs where llama-cpp-python is installed (the [peers] extra; make test does not install it)."""
    pytest.importorskip("llama_cpp")
    from hybridkv.bench.llama_cpp import run as run_llama_cpp

    plan = QUICK.replace(prefill_lens=(64, 128), decode_prompt=32, decode_steps=3, reps=1, warmup=0)
    plan = plan.replace(chat=ChatLayout(turns=3, system=12, user=12, header=3, reply=8, edited=4))
    doc = run_llama_cpp(GGUF_K, 1, plan, log=lambda line: None)
    s = doc["scenarios"]
    assert list(s) == ["prefill_64", "decode_b1", "decode_b8", "chat_turn8_ttft", "regenerate_ttft"]
    assert all(v["hybridkv"] > 0 and v["llama.cpp"] > 0 for v in s.values())
    regen = s["regenerate_ttft"]  # the answer dropped: hybridkv from its snapshot, llama.cpp from scratch
    assert regen["hybridkv_tokens_computed"] == 3 and regen["llama_cpp_tokens_computed"] == regen["prompt_tokens"]
    d = s["decode_b1"]  # against the bandwidth roofline: the step's bytes over the faster probe
    assert len(d["read_gb_s_probes"]) == 2 and d["roofline_target"] == 1.3
    floor_ms = 1e3 * d["read_bytes_per_token"] / (1e9 * max(d["read_gb_s_probes"]))
    assert d["roofline_ms"] == pytest.approx(floor_ms)
    assert d["hybridkv_of_roofline"] == pytest.approx(d["hybridkv"] / floor_ms)
    assert d["llama_cpp_of_roofline"] == pytest.approx(d["llama.cpp"] / floor_ms)
    out = io.StringIO()
    from hybridkv.bench.llama_cpp import print_llama_cpp

    print_llama_cpp(doc, Console(file=out, width=160))
    text = out.getvalue()
    assert "hybridkv vs llama.cpp" in text and "regenerate_ttft" in text and "bandwidth roofline" in text
    from hybridkv.bench.llama_cpp import fetch_ahead

    assert doc["run"]["decode_fetch_ahead"] is fetch_ahead()  # the load's choice, None without C++ kernels
    assert ("(chosen at load)" in text) == (fetch_ahead() is not None)
    assert doc["run"]["hybridkv_threads"] == "fixed" and "left idle" not in text
    adapted = run_llama_cpp(GGUF_K, 1, plan, log=lambda line: None, adapt_threads=True)  # as its engine, <= 1
    assert adapted["run"]["hybridkv_threads"] == [1]
    out = io.StringIO()
    print_llama_cpp(adapted, Console(file=out, width=400))
    assert "hybridkv on the cores other processes left idle, as its engine without --threads: 1 thread(s) used" in (
        out.getvalue()
    )


def test_the_llama_cpp_bench_sets_hybridkvs_threads_before_each_timed_call():
    from hybridkv.bench.llama_cpp import OurThreads

    counts = iter([2, 1, 1, 2])

    class Cores:
        def update(self) -> int:
            return next(counts)

    threads = OurThreads(Cores())  # type: ignore[arg-type]
    for _ in range(4):
        threads()
    assert threads.used == {1, 2}
    fixed = OurThreads(None)
    fixed()
    assert fixed.used == set()


@pytest.mark.parametrize("name", ["qwen35moe-k-q4_k_m.gguf", "qwen35-tiny-q8_0.gguf"])
def test_a_gguf_models_decode_reads_the_files_bytes_by_role(name):
    """The roofline's bytes a step: every tensor of the file as its type weighs it (gguf-py's
    sizes), less the embedding when the head is untied (a step reads only its rows; tied, it is
    the head and read whole) and the routed experts a token did not choose (top-k of E). A MoE
    file with K-quant experts and an untied head; a dense one with a tied head and an MTP layer
    appended (`blk.N` past the decoder: not loaded, not counted)."""
    import gguf

    path = GGUF_K.parent / name
    model = CachedModel.load(path).model
    layers = model.config.num_hidden_layers
    sizes = {
        t.name: int(t.n_bytes)
        for t in gguf.GGUFReader(path).tensors
        if not (t.name.startswith("blk.") and int(t.name.split(".")[1]) >= layers)
    }
    counts = WeightCounts.of(model)
    tied = "output.weight" not in sizes
    experts = sum(n for tensor, n in sizes.items() if "_exps." in tensor)
    assert counts.tied == tied and (experts > 0) == ("moe" in name)
    assert (counts.total_bytes, counts.embed_bytes, counts.experts_bytes) == (
        sum(sizes.values()),
        sizes["token_embd.weight"],
        experts,
    )
    active = model.config.num_experts_per_tok / model.config.num_experts if experts else 1.0
    expected = sum(sizes.values()) - (0 if tied else sizes["token_embd.weight"]) - experts * (1 - active)
    assert counts.decode_bytes(1) == pytest.approx(expected)


@pytest.mark.parametrize("file_type", ["q8_0", "q4_k_m"])
def test_without_a_model_the_llama_cpp_peer_writes_the_shape_as_a_gguf_file(tmp_path, file_type):
    """Q8_0 by `hybridkv quantize`; Q4_K_M by llama.cpp's quantizer (where llama-cpp-python is
    installed) from our BF16 file. Written beside the checkpoint once, then reused. A shape has
    no tokenizer of its own: the bench writes a byte-level one first (a GGUF file needs one)."""
    from hf_reference import make_hf_model, save_checkpoint

    from hybridkv.bench.llama_cpp import shape_file
    from hybridkv.engine.tokenizer import Tokenizer
    from hybridkv.models.gguf import GGUFFile, file_type_name

    if file_type == "q4_k_m":
        pytest.importorskip("llama_cpp")
    checkpoint = save_checkpoint(make_hf_model(vocab_size=4096), tmp_path / "shape")
    lines: list[str] = []
    path = shape_file(checkpoint, file_type, lines.append)
    assert path == tmp_path / f"shape-{file_type}.gguf"
    with GGUFFile(path) as f:
        assert file_type_name(f.metadata) == file_type.upper()
        tokenizer = Tokenizer.from_gguf_metadata(f.metadata)
    ids = tokenizer.encode("<|im_start|> the café")
    assert ids[:2] == [260, 258] and tokenizer.decode(ids) == "<|im_start|> the café"
    assert tokenizer.eos_token_ids == {259, 261}  # <|endoftext|> and <|im_end|>
    assert shape_file(checkpoint, file_type, lines.append) == path and lines[-1] == f"using {path}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shape", path.name]  # no BF16 or partial file left


def test_a_qwen3_5_shape_tokenizer_puts_qwens_tokens_at_their_ids(tmp_path):
    from hybridkv.bench.workload import write_bench_tokenizer
    from hybridkv.engine.tokenizer import Tokenizer

    write_bench_tokenizer(tmp_path, 248_320)
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert tokenizer.encode("<|endoftext|><|im_start|><|im_end|>") == [248_044, 248_045, 248_046]
    with pytest.raises(ValueError, match="vocabulary of at least 262, got 100"):
        write_bench_tokenizer(tmp_path, 100)
