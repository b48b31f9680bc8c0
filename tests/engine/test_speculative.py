"""Speculative decoding: the output equals plain decoding (token for token when greedy, in
distribution when sampled), and a token that was not accepted is never visible anywhere."""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridkv import CacheConfig
from hybridkv.engine.engine import EngineConfig
from hybridkv.engine.grammar import Grammar, json_value
from hybridkv.engine.llm import LLM, default_cache_config
from hybridkv.engine.request import Request
from hybridkv.engine.sampling import SamplingParams
from hybridkv.engine.speculative import AdaptiveDraft, NgramIndex, SpeculativeConfig
from hybridkv.errors import NotSupported

# -- drafts -----------------------------------------------------------------------------------


def test_ngram_lookup_proposes_what_followed_the_latest_longest_match() -> None:
    index = NgramIndex(n_min=2, n_max=3)
    index.extend([1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3])
    assert index.propose(2) == [4, 9]  # the longest suffix seen before, (1, 2, 3), wins over (2, 3)
    index = NgramIndex(n_min=2, n_max=3)
    index.extend([1, 2, 3, 4, 7, 2, 3, 5, 6, 8, 2, 3])
    assert index.propose(2) == [5, 6]  # (8, 2, 3) is new; (2, 3) last seen before 5 6
    index = NgramIndex(n_min=2, n_max=3)
    index.extend([7, 1, 2, 3, 4, 8, 8, 1, 2, 3])
    assert index.propose(3) == [4, 8, 8]  # the longest match wins
    # a 3-token match (7 and 8 before it differ) drafts NGRAM_MIN_DRAFT = 4 however many are asked
    assert index.propose(9) == [4, 8, 8, 1]
    index.extend([42])
    assert index.propose(4) == []  # (3, 42) never seen
    index.extend([5, 5, 5])
    assert index.propose(4) == [5, 5, 5, 5]  # a run: period 1


def test_ngram_draft_is_as_long_as_the_copy_so_far() -> None:
    """The present has copied the earlier text for `run` tokens: the draft is that long (at
    least 4, at most k), and a loop shorter than the draft goes on periodically."""
    text = [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63]
    index = NgramIndex(n_min=2, n_max=4)
    index.extend([9, *text, 7, *text[:6]])  # the last 6 tokens copy text[:6]; 9 and 7 before them differ
    assert index.propose(16) == text[6:12]
    assert index.propose(5) == text[6:11]
    index.extend(text[6:10])  # 10 copied: a 10-token draft
    assert index.propose(16) == text[10:14] + [7, *text[:5]]
    index = NgramIndex(n_min=2, n_max=4)
    index.extend([1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2])  # period 3, copied for 8 tokens
    assert index.propose(16) == [3, 1, 2, 3, 1, 2, 3, 1]


def test_adaptive_k_grows_on_full_accepts_shrinks_on_misses_and_pauses() -> None:
    draft = AdaptiveDraft(k_max=4)
    assert draft.next_k() == 2
    draft.update(2, 2)
    draft.update(3, 3)
    assert draft.next_k() == 4
    draft.update(4, 1)
    assert draft.next_k() == 2  # accepted 1: try 2
    for _ in range(3):
        draft.update(2, 0)
    assert [draft.next_k() for _ in range(5)] == [0, 0, 0, 0, 1]  # three misses: a 4-step pause
    for _ in range(3):
        draft.update(1, 0)
    assert sum(draft.next_k() == 0 for _ in range(9)) == 8  # paused again, twice as long


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(method="medusa"), "off, ngram, mtp, auto"),
        (dict(num_tokens=0), "1..16"),
        (dict(ngram_min=3, ngram_max=2), "ngram_max"),
        (dict(draft_budget=0), "draft_budget"),
    ],
)
def test_bad_speculation_settings_say_what_to_change(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig(**kwargs)


def test_k_defaults_by_draft_and_the_budget_is_shared() -> None:
    assert [SpeculativeConfig(m).k for m in ("off", "ngram", "auto", "mtp")] == [0, 16, 16, 4]
    assert SpeculativeConfig("mtp", 6).k == 6
    spec = SpeculativeConfig("ngram", 8, draft_budget=16)
    assert [spec.per_sequence(n) for n in (0, 1, 2, 3, 8, 16, 40)] == [8, 8, 8, 5, 2, 1, 1]
    # rows for the most drafts any forward of up to 8 (or 40) sequences can verify
    assert spec.verify_rows(8) == 16 and spec.verify_rows(40) == 40
    assert SpeculativeConfig("ngram", 2).verify_rows(4) == 8  # k × sequences, below the budget


def test_engine_refuses_speculation_without_verify_rows_and_mtp_without_a_block(
    chat_model: tuple[Path, Any],
) -> None:
    with pytest.raises(ValueError, match="verify_rows"):
        LLM(cache=CacheConfig(max_sequences=17), speculative="ngram")
    with pytest.raises(NotSupported, match="MTP|multi-token"):
        LLM(chat_model[0], speculative="mtp")  # a checkpoint without mtp.* weights


# -- exactness --------------------------------------------------------------------------------


def make_llm(method: str, **cache: Any) -> LLM:
    """The default model (trained: it quotes its context, so prompt lookup drafts get accepted)."""
    engine = EngineConfig(max_num_seqs=4, speculative=SpeculativeConfig(method, num_tokens=4))  # type: ignore[arg-type]
    settings: dict[str, Any] = dict(max_model_len=512, snapshot_interval=16, snapshots_per_sequence=8)
    settings.update(cache)
    return LLM(cache=default_cache_config(engine, **settings), engine=engine)


@functools.cache
def heldout_ids() -> list[int]:
    text = (Path(__file__).parents[1] / "data" / "default_model_heldout.txt").read_text()[:40_000]
    return make_llm("off").encode(text)


def run_program(llm: LLM, seed: int) -> dict[str, Request]:
    """A fixed schedule of requests driven step by step, the cache checked after every step:
    greedy prompts from held-out text, a follow-up turn extending a finished request (prefix
    reuse), a seeded n=2 request (forks), a cancellation; the KV budget makes them preempt."""
    gen = torch.Generator().manual_seed(seed)
    text = heldout_ids()

    def prompt(n: int) -> list[int]:
        start = int(torch.randint(0, len(text) - n, (1,), generator=gen))
        return text[start : start + n]

    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2)
    sampled = SamplingParams(max_tokens=24, temperature=0.7, top_k=12, seed=seed, n=2, ignore_eos=True)
    requests = {"a": llm.submit(prompt(120), greedy), "b": llm.submit(prompt(60), sampled)}
    requests["e"] = llm.submit(prompt(90), greedy)
    step = 0
    while not all(r.finished for r in requests.values()) or "c" not in requests:
        if requests["a"].finished and "c" not in requests:
            a = requests["a"]
            requests["c"] = llm.submit(a.prompt_ids + a.output().outputs[0].token_ids + prompt(5), greedy)
            requests["d"] = llm.submit(prompt(100), greedy)
        if step == 30 and "d" in requests:
            llm.engine.cancel(requests["d"].request_id)
        llm.engine.step()
        step += 1
        check_only_verified_tokens_are_visible(llm, requests.values())
    return requests


def check_only_verified_tokens_are_visible(llm: LLM, requests: Any) -> None:
    """After every step: the cache is whole, and every sequence — running or kept for reuse —
    holds a prefix of some request's prompt and sampled output, never a rejected draft."""
    llm.cm.cache.check_integrity()
    histories = [r.prompt_ids + b.completion.token_ids for r in requests for b in r.branches]
    for seq in llm.cm.cache.sequences():
        tokens = llm.cm.tokens(seq)
        assert any(h[: len(tokens)] == tokens for h in histories), f"sequence {seq} holds tokens no request produced"
    for r in requests:
        for b in r.branches:
            if b.seq is not None:
                assert len(llm.cm.tokens(b.seq)) <= len(r.prompt_ids) + max(len(b.completion.token_ids) - 1, 0)


def compare_greedy(plain: Request, spec: Request) -> int:
    """Tokens compared before the first difference, which must be a near-tie of plain decoding's
    two best tokens (float32 logits of a [k+1]-row forward differ from a 1-row one by ~1e-6)."""
    want, got = plain.branches[0].completion, spec.branches[0].completion
    for i, (w, g) in enumerate(zip(want.token_ids, got.token_ids, strict=False)):
        if w != g:
            top = want.logprobs[i][2]
            assert top is not None and top[0][1] - top[1][1] < 1e-4, f"token {i} differs without a near-tie"
            return i
    return min(len(want.token_ids), len(got.token_ids))


@pytest.mark.parametrize(
    "seed, tight, method", [(0, True, "ngram"), (1, True, "mtp"), (2, False, "ngram"), (3, False, "mtp")]
)
def test_greedy_and_seeded_output_equal_plain_decoding_under_a_mixed_program(
    seed: int, tight: bool, method: str
) -> None:
    """`tight`: KV for about two sequences, so requests are preempted and resumed (and the
    follow-up turn finds its prefix evicted); else room enough that it reuses it."""

    def engine(m: str) -> LLM:
        kv = 330 * make_llm(m).cm.cache.spec.kv_bytes_per_token if tight else None
        return make_llm(m, block_size=4, kv_bytes=kv, max_model_len=256)

    plain_llm, spec_llm = engine("off"), engine(method)
    plain, spec = run_program(plain_llm, seed), run_program(spec_llm, seed)
    compared = total = 0
    for name in ("a", "c", "e"):
        compared += compare_greedy(plain[name], spec[name])
        total += len(plain[name].branches[0].completion.token_ids)
    assert compared >= 0.9 * total
    b_plain, b_spec = plain["b"].branches, spec["b"].branches
    assert [b.completion.token_ids for b in b_spec] == [b.completion.token_ids for b in b_plain]
    d_plain, d_spec = (r["d"].branches[0].completion.token_ids for r in (plain, spec))
    assert d_spec[: len(d_plain)] == d_plain[: len(d_spec)]  # cancelled at step 30: lengths differ
    metrics = spec_llm.engine.metrics()
    assert 0 < metrics["spec_accepted_tokens"] < metrics["spec_draft_tokens"]  # both paths taken
    usage = [r.usage for r in spec.values()]
    assert sum(u.draft_tokens for u in usage) == metrics["spec_draft_tokens"]
    assert sum(u.accepted_tokens for u in usage) == metrics["spec_accepted_tokens"]
    assert spec_llm.engine.counters["steps"] < plain_llm.engine.counters["steps"]
    if tight:
        assert spec_llm.engine.counters["preemptions"] > 0
    else:
        assert spec["c"].usage.cached_tokens == plain["c"].usage.cached_tokens > 150


def test_sequences_drafting_together_share_the_draft_budget() -> None:
    """k = 8 within a budget of 6: a forward verifying v sequences' drafts holds at most
    max(1, 6 // v) of each, 6 for one alone; the output is plain decoding's either way."""
    engine = EngineConfig(max_num_seqs=4, speculative=SpeculativeConfig("ngram", num_tokens=8, draft_budget=6))
    llm = LLM(cache=default_cache_config(engine, max_model_len=512), engine=engine)
    assert llm.cm.cache.config.verify_rows == 6  # min(8 × 4, max(6, 4))
    prompt = heldout_ids()[:40] * 3
    # 48 tokens: the output repeats itself from its 18th token on, so lookups find long drafts
    greedy = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    want = make_llm("off").generate(prompt, greedy)[0].outputs[0].token_ids
    longest: dict[int, int] = {}  # sequences verified in one step -> most drafts one of them held
    for copies in (1, 4):
        requests = [llm.submit(prompt, greedy) for _ in range(copies)]
        while not all(r.finished for r in requests):
            before = Counter(llm.engine.counters)
            llm.engine.step()
            counts = Counter(llm.engine.counters)
            counts.subtract(before)
            if verifies := counts["spec_draft_tokens_1"]:
                drafts = max(p for p in range(1, 9) if counts[f"spec_draft_tokens_{p}"])
                assert counts["spec_draft_tokens"] <= 6 and drafts <= max(1, 6 // verifies)
                longest[verifies] = max(longest.get(verifies, 0), drafts)
        assert all(r.branches[0].completion.token_ids == want for r in requests)
    assert longest[1] == 6 and any(v >= 2 for v in longest)  # both cases met


# -- sampled output ---------------------------------------------------------------------------


def chi_square_p(a: Counter[int], b: Counter[int]) -> float:
    """p-value of a chi-square test that two samples come from one distribution (categories with
    fewer than 10 expected draws pooled into one)."""
    na, nb = sum(a.values()), sum(b.values())
    rows: list[tuple[float, float]] = []
    pooled = [0.0, 0.0]
    for token in sorted(set(a) | set(b)):
        if (a[token] + b[token]) * min(na, nb) / (na + nb) < 10:
            pooled[0] += a[token]
            pooled[1] += b[token]
        else:
            rows.append((a[token], b[token]))
    if sum(pooled):
        rows.append((pooled[0], pooled[1]))
    stat = 0.0
    for x, y in rows:
        total = x + y
        for observed, n in ((x, na), (y, nb)):
            expected = total * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    dof = len(rows) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def test_sampled_tokens_follow_the_same_distribution_with_and_without_speculation() -> None:
    """Independent seeds on each side, 400 samples of 5 tokens from a prompt that repeats itself
    (so drafts are proposed and often accepted, sometimes not): each position's token
    distribution passes a chi-square test at significance 1e-3."""
    prompt = heldout_ids()[:40] * 3

    def samples(method: str, seeds: range) -> list[list[int]]:
        llm = make_llm(method)
        tokens = []
        for chunk in range(seeds.start, seeds.stop, 100):
            params = [SamplingParams(max_tokens=5, temperature=0.9, top_k=6, seed=s, ignore_eos=True) for s in seeds]
            requests = [llm.submit(prompt, p) for p in params[chunk - seeds.start : chunk - seeds.start + 100]]
            llm.engine.run_until_done()
            tokens += [r.branches[0].completion.token_ids for r in requests]
        if method != "off":
            m = llm.engine.metrics()
            assert 0 < m["spec_accepted_tokens"] < m["spec_draft_tokens"]
        return tokens

    with_spec, without = samples("ngram", range(400)), samples("off", range(10_000, 10_400))
    for position in range(5):
        p = chi_square_p(Counter(s[position] for s in with_spec), Counter(s[position] for s in without))
        assert p > 1e-3, f"position {position}: p = {p:.2g}"
    # the test has power: a shifted distribution (every token moved by one) is rejected
    shifted = Counter(s[1] + 1 for s in without)
    assert chi_square_p(Counter(s[1] for s in with_spec), shifted) < 1e-3


# -- what clients see -------------------------------------------------------------------------


def test_stops_grammar_and_max_tokens_end_where_plain_decoding_ends() -> None:
    plain, spec = make_llm("off"), make_llm("ngram")
    prompt = heldout_ids()[100:160] * 2
    runs = [
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[62]),
        SamplingParams(max_tokens=30, temperature=0.0, stop=[plain.tokenizer.decode([63, 64])]),
    ]
    for params in runs:
        want, got = plain.generate(prompt, params)[0], spec.generate(prompt, params)[0]
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert (got.outputs[0].finish_reason, got.outputs[0].text) == (want.outputs[0].finish_reason, want.text)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    constrained = SamplingParams(max_tokens=40, temperature=0.0, grammar=Grammar(f"start: {json_value(schema)}\n"))
    want, got = plain.generate(prompt, constrained)[0], spec.generate(prompt, constrained)[0]
    assert got.text == want.text
    for llm in (plain, spec):
        for seq in llm.cm.cache.sequences():  # kept for reuse: prompt + output, the last token unfed
            assert len(llm.cm.tokens(seq)) <= len(prompt) + 40
        llm.cm.cache.check_integrity()


def test_auto_pauses_on_text_it_cannot_guess() -> None:
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 250, (60,), generator=gen).tolist()
    llm = make_llm("auto")
    out = llm.generate(prompt, SamplingParams(max_tokens=60, temperature=1.5, seed=1, ignore_eos=True))[0]
    drafted = out.usage.draft_tokens
    assert drafted <= 40, drafted  # sampled at a high temperature drafts rarely hold: auto backs off
    assert out.usage.completion_tokens == 60
