"""Prompt logprobs: every prompt token scored as a fresh forward over the prompt scores it, whatever
the chunking, the batch or the prefix cache held before; `max_tokens=0` scores without generating."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hf_reference import hf_logits

from hybridkv import CacheConfig
from hybridkv.engine import engine as engine_module
from hybridkv.engine.engine import EngineConfig
from hybridkv.engine.llm import LLM
from hybridkv.engine.request import RequestOutput
from hybridkv.engine.sampling import SamplingParams, TokenLogprob, score_tokens

SCORE = SamplingParams(max_tokens=0, prompt_logprobs=5)
TOL = 1e-4


def make_llm(chat_model: tuple[Path, Any], chunk: int = 1024) -> LLM:
    cache = CacheConfig(max_sequences=17, max_model_len=2048, snapshots_per_sequence=16)
    return LLM(chat_model[0], cache=cache, engine=EngineConfig(max_num_seqs=8, max_num_batched_tokens=chunk))


def prompt_of(llm: LLM, n: int, topic: str = "document") -> list[int]:
    ids = llm.encode(" ".join(f"line {i} of a shared {topic}." for i in range(n)))
    return ids[:n]


def no_cache_log_probs(llm: LLM, ids: list[int]) -> torch.Tensor:
    """log_softmax over one forward of a fresh sequence (CachedModel, nothing reused): [n, V]."""
    seq = llm.cm.new_sequence()
    try:
        logits = llm.cm.feed({seq: ids}, logits="all")[seq]
    finally:
        llm.cm.release(seq)
    return torch.log_softmax(logits, dim=-1)


def assert_scores(entries: list[TokenLogprob | None], ids: list[int], want: torch.Tensor, k: int) -> None:
    """`entries` score `ids` as the reference log-probs `want: [n, V]` (row p predicts token p + 1)."""
    assert len(entries) == len(ids) and entries[0] is None
    for p, entry in enumerate(entries[1:], start=1):
        assert entry is not None and entry.token_id == ids[p]
        row = want[p - 1]
        assert entry.logprob == pytest.approx(float(row[ids[p]]), abs=TOL)
        value = float(row[ids[p]])
        assert int((row > value + TOL).sum()) + 1 <= entry.rank <= int((row > value - TOL).sum()) + 1
        assert len(entry.top) == k
        ref = torch.topk(row, k).values.tolist()
        assert [v for _, v in entry.top] == pytest.approx(ref, abs=TOL)
        for token, value in entry.top:
            assert value == pytest.approx(float(row[token]), abs=TOL)
            if token == entry.token_id:
                assert value == entry.logprob  # one log_softmax: bit-identical
        if entry.rank == 1:
            assert entry.top[0][1] == entry.logprob


def score(llm: LLM, ids: list[int], params: SamplingParams = SCORE) -> RequestOutput:
    [out] = llm.generate(ids, params)
    llm.cm.cache.check_integrity()
    return out


def test_prompt_logprobs_equal_transformers_and_a_no_cache_forward(chat_model: tuple[Path, Any]) -> None:
    llm = make_llm(chat_model)
    ids = prompt_of(llm, 40)
    out = score(llm, ids)
    assert out.prompt_logprobs is not None
    assert_scores(out.prompt_logprobs, ids, torch.log_softmax(hf_logits(chat_model[1], ids), dim=-1), 5)
    assert_scores(out.prompt_logprobs, ids, no_cache_log_probs(llm, ids), 5)
    [completion] = out.outputs
    assert completion.token_ids == [] and completion.finish_reason == "length" and completion.text == ""
    assert (out.usage.completion_tokens, out.usage.computed_tokens) == (0, len(ids))


def test_a_prefix_cache_hit_is_recomputed_and_the_scored_prompt_is_reused_after(chat_model: tuple[Path, Any]) -> None:
    llm = make_llm(chat_model)
    ids = prompt_of(llm, 60)
    warm = score(llm, ids, SamplingParams(max_tokens=2, temperature=0.0))
    assert warm.prompt_logprobs is None
    assert score(llm, ids, SamplingParams(max_tokens=1, temperature=0.0)).usage.cached_tokens == len(ids) - 1

    scored = score(llm, ids)  # the whole prompt is cached, and computed again for its logits
    assert (scored.usage.cached_tokens, scored.usage.computed_tokens) == (0, len(ids))
    assert scored.prompt_logprobs is not None
    assert_scores(scored.prompt_logprobs, ids, torch.log_softmax(hf_logits(chat_model[1], ids), dim=-1), 5)

    longer = [*ids, *prompt_of(llm, 10, "appendix")]
    after = score(llm, longer, SamplingParams(max_tokens=1, temperature=0.0))
    assert after.usage.cached_tokens >= len(ids) - 1  # what the scoring request computed is reused


def test_chunked_and_batched_scoring_equals_one_forward(
    chat_model: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_module, "SCORED_ROWS_PER_STEP", 7)  # chunks of 7 under a budget of 16
    llm = make_llm(chat_model, chunk=16)
    ids = prompt_of(llm, 50)
    other = prompt_of(llm, 30, "story")
    scored = llm.submit(ids, SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=3, logprobs=2))
    plain = llm.submit(other, SamplingParams(max_tokens=3, temperature=0.0))  # shares the batches
    llm.engine.run_until_done()
    llm.cm.cache.check_integrity()
    out = scored.output()
    assert out.prompt_logprobs is not None and plain.output().prompt_logprobs is None
    want = torch.log_softmax(hf_logits(chat_model[1], [*ids, *out.outputs[0].token_ids]), dim=-1)
    assert_scores(out.prompt_logprobs, ids, want[: len(ids)], 3)
    # the generated tokens' logprobs continue the same distribution
    for i, (token, logprob, _) in enumerate(out.outputs[0].logprobs):
        assert logprob == pytest.approx(float(want[len(ids) - 1 + i, token]), abs=TOL)
    assert out.usage.computed_tokens == len(ids)


def test_n_completions_share_one_scored_prompt(chat_model: tuple[Path, Any]) -> None:
    llm = make_llm(chat_model)
    ids = prompt_of(llm, 20)
    out = score(llm, ids, SamplingParams(max_tokens=4, temperature=1.0, seed=3, n=2, prompt_logprobs=0))
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids)
    assert all(entry is None or entry.top == () for entry in out.prompt_logprobs)
    assert [len(c.token_ids) for c in out.outputs] == [4, 4]
    assert out.usage.computed_tokens == len(ids)
    nothing = score(llm, ids, SamplingParams(max_tokens=0, n=2))
    assert [(c.token_ids, c.finish_reason) for c in nothing.outputs] == [([], "length"), ([], "length")]


def test_a_one_token_prompt_has_one_null_entry(chat_model: tuple[Path, Any]) -> None:
    llm = make_llm(chat_model)
    assert score(llm, [65]).prompt_logprobs == [None]


def test_score_tokens_ranks_ties_and_bounds() -> None:
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    first, second = score_tokens(logits, [2, 3], top=2)
    assert (first.rank, second.rank) == (2, 1)  # ties share the better rank
    assert first.top[0][0] == 0 and first.logprob == first.top[1][1]
    assert second.logprob == pytest.approx(-float(torch.log(torch.tensor(4.0))))
    with pytest.raises(ValueError, match="R = 1"):
        score_tokens(logits, [1], top=1)


def test_a_scoring_request_preempted_mid_prompt_is_scored_again_from_the_start(
    chat_model: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decodes while B computes its scored prompt in chunks of 8; A's growth fills the KV blocks
    before B's prompt is done, so B (the newest) is preempted mid-prompt and later recomputed."""
    monkeypatch.setattr(engine_module, "SCORED_ROWS_PER_STEP", 8)
    gen = torch.Generator().manual_seed(1)
    a, b = (torch.randint(0, 256, (n,), generator=gen).tolist() for n in (36, 100))
    decode = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    scoring = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    alone = score(make_llm(chat_model), b, scoring)

    spec = make_llm(chat_model).cm.cache.spec
    cache = CacheConfig(max_sequences=9, max_model_len=128, block_size=4, kv_bytes=36 * 4 * spec.kv_bytes_per_token)
    tight = LLM(chat_model[0], cache=cache, engine=EngineConfig(max_num_seqs=4))
    scoring_when_preempted: list[bool] = []
    relieve = tight.engine._relieve_pressure

    def record() -> None:
        scoring_when_preempted.extend(r.scoring_prompt for r in tight.engine.running[1:])
        relieve()

    monkeypatch.setattr(tight.engine, "_relieve_pressure", record)
    first, second = tight.submit(a, decode), tight.submit(b, scoring)
    tight.engine.run_until_done()
    tight.cm.cache.check_integrity()
    assert True in scoring_when_preempted and second.usage.preemptions >= 1
    assert second.usage.computed_tokens > len(b)  # scored again from the start
    out = second.output()
    assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    assert first.output().outputs[0].finish_reason == "length"
    assert out.prompt_logprobs is not None and alone.prompt_logprobs is not None
    assert len(out.prompt_logprobs) == len(b) and out.prompt_logprobs[0] is None
    for got, ref in zip(out.prompt_logprobs[1:], alone.prompt_logprobs[1:], strict=True):
        assert got is not None and ref is not None
        assert (got.token_id, got.rank, [t for t, _ in got.top]) == (ref.token_id, ref.rank, [t for t, _ in ref.top])
        assert got.logprob == pytest.approx(ref.logprob, abs=TOL)


def test_the_default_model_scores_prompts_as_transformers_does() -> None:
    from transformers import Qwen3NextForCausalLM

    from hybridkv.default_model import default_model_dir

    llm = LLM(cache=CacheConfig(max_sequences=3, max_model_len=256), engine=EngineConfig(max_num_seqs=1))
    ids = llm.encode("The function returns a list of the values in the dictionary.")
    out = score(llm, ids, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=3))
    model = Qwen3NextForCausalLM.from_pretrained(default_model_dir(), torch_dtype=torch.float32).eval()
    want = torch.log_softmax(hf_logits(model, ids), dim=-1)
    assert out.prompt_logprobs is not None
    assert_scores(out.prompt_logprobs, ids, want, 3)
    assert sum(e.rank == 1 for e in out.prompt_logprobs[1:] if e is not None) >= len(ids) // 4  # a trained model
