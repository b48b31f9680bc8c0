"""Sampling parameters, token choice and stop detection behave as OpenAI/vLLM/HF users expect."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from hybridkv.engine.sampling import (
    RequestSampler,
    SampleResult,
    SamplingParams,
    StopChecker,
    sample_batch,
)

V = 5


def _logits(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def _random_logits(seed: int, vocab: int = 1000) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _draws(sampler: RequestSampler, logits: torch.Tensor, count: int) -> list[int]:
    return [sampler.sample(logits, []).token_id for _ in range(count)]


# --- SamplingParams ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", -1),
        ("max_tokens", -5),
        ("max_tokens", True),
        ("max_tokens", 3.0),
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", 101.0),
        ("top_k", -1),
        ("top_k", False),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", math.nan),
        ("min_p", 1.0),
        ("min_p", -0.1),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", math.inf),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("frequency_penalty", math.nan),
        ("seed", -1),
        ("seed", 2**64),
        ("seed", 1.5),
        ("stop", ("",)),
        ("stop", tuple(f"s{i}" for i in range(17))),
        ("stop", (1,)),
        ("stop_token_ids", (-1,)),
        ("stop_token_ids", (True,)),
        ("ignore_eos", 1),
        ("logprobs", 21),
        ("logprobs", -1),
        ("prompt_logprobs", 21),
        ("prompt_logprobs", -1),
        ("n", 0),
        ("n", 17),
    ],
)
def test_absurd_parameters_are_rejected_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_stop_accepts_a_single_string_and_lists() -> None:
    assert SamplingParams(stop="###").stop == ("###",)  # type: ignore[arg-type]
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[3]).stop == ("a", "b")  # type: ignore[arg-type]


def test_unset_fields_come_from_generation_config_and_set_fields_win() -> None:
    config = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": None}
    params = SamplingParams(top_k=5).with_defaults(config)
    assert (params.temperature, params.top_p, params.top_k) == (0.7, 0.8, 5)
    assert (params.min_p, params.repetition_penalty) == (0.0, 1.0)  # neutral when nobody says


def test_do_sample_false_in_generation_config_means_greedy_by_default() -> None:
    assert SamplingParams().with_defaults({"do_sample": False, "temperature": 0.6}).temperature == 0.0
    assert SamplingParams(temperature=0.5).with_defaults({"do_sample": False}).temperature == 0.5
    assert SamplingParams().with_defaults({}).temperature == 1.0


def test_bad_generation_config_values_are_reported_by_field() -> None:
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams().with_defaults({"top_p": 0})


# --- choosing tokens ----------------------------------------------------------------------------


def test_greedy_is_argmax_and_does_not_consume_randomness() -> None:
    logits = _random_logits(0)
    sampler = RequestSampler(SamplingParams(temperature=0.0, seed=1), [])
    state = sampler.generator.get_state()
    assert sampler.sample(logits, []).token_id == int(logits.argmax())
    assert torch.equal(sampler.generator.get_state(), state)


def test_same_seed_same_tokens_and_different_seeds_differ() -> None:
    logits = _random_logits(1, vocab=50) / 3  # flat enough that draws vary
    first = _draws(RequestSampler(SamplingParams(seed=7), []), logits, 30)
    assert _draws(RequestSampler(SamplingParams(seed=7), []), logits, 30) == first
    assert _draws(RequestSampler(SamplingParams(seed=8), []), logits, 30) != first


def test_seeded_request_is_unaffected_by_others_in_the_batch() -> None:
    logits = _random_logits(2, vocab=50) / 3
    alone = RequestSampler(SamplingParams(seed=3), [])
    expected = [sample_batch([alone], logits[None], [[]])[0].token_id for _ in range(20)]

    seeded = RequestSampler(SamplingParams(seed=3), [])
    others = [RequestSampler(SamplingParams(seed=s, top_k=10), []) for s in (4, 5)]
    got = []
    for step in range(20):
        batch = [*others[: step % 3], seeded]  # batch size and neighbours change every step
        noise = [_random_logits(100 + step + i, vocab=50) for i in range(len(batch) - 1)]
        results = sample_batch(batch, torch.stack([*noise, logits]), [[]] * len(batch))
        got.append(results[-1].token_id)
    assert got == expected


def test_branches_of_a_seeded_request_differ_but_are_reproducible() -> None:
    logits = _random_logits(3, vocab=50) / 3
    params = SamplingParams(seed=11, n=2)
    branch0 = _draws(RequestSampler(params, [], branch=0), logits, 20)
    branch1 = _draws(RequestSampler(params, [], branch=1), logits, 20)
    assert branch0 != branch1
    assert _draws(RequestSampler(params, [], branch=1), logits, 20) == branch1


def test_top_k_1_and_tiny_top_p_are_greedy() -> None:
    for seed in range(5):
        logits = _random_logits(seed)
        best = int(logits.argmax())
        assert set(_draws(RequestSampler(SamplingParams(top_k=1, seed=seed), []), logits, 10)) == {best}
        assert set(_draws(RequestSampler(SamplingParams(top_p=1e-9, seed=seed), []), logits, 10)) == {best}


def test_top_k_and_top_p_keep_only_the_likely_tokens() -> None:
    logits = torch.log(_logits(0.4, 0.3, 0.2, 0.06, 0.04))
    top_k = set(_draws(RequestSampler(SamplingParams(top_k=2, seed=0), []), logits, 300))
    assert top_k == {0, 1}
    # mass 0.4 + 0.3 = 0.7 < 0.75, so the 0.2 token is needed too; 0.06 and 0.04 are not
    top_p = set(_draws(RequestSampler(SamplingParams(top_p=0.75, seed=0), []), logits, 300))
    assert top_p == {0, 1, 2}


def test_top_k_keeps_ties_at_the_kth_value() -> None:
    logits = _logits(2.0, 1.0, 1.0, 0.0, 0.0)
    assert set(_draws(RequestSampler(SamplingParams(top_k=2, seed=0), []), logits, 200)) == {0, 1, 2}


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p, repetition_penalty",
    [
        (1.0, 0, 1.0, 0.0, 1.0),
        (0.7, 20, 0.8, 0.0, 1.0),  # Qwen3's generation_config
        (1.3, 0, 0.9, 0.05, 1.1),
        (0.5, 50, 1.0, 0.1, 0.9),
        (2.0, 7, 0.3, 0.0, 1.5),
    ],
)
def test_distribution_matches_transformers_logits_processors(
    temperature: float, top_k: int, top_p: float, min_p: float, repetition_penalty: float
) -> None:
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    prompt, output = [3, 10, 10, 42], [7, 3, 99]
    params = SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty
    )
    hf_chain = [RepetitionPenaltyLogitsProcessor(repetition_penalty), TemperatureLogitsWarper(temperature)]
    hf_chain += [TopKLogitsWarper(top_k)] if top_k else []
    hf_chain += [TopPLogitsWarper(top_p)] if top_p < 1.0 else []
    hf_chain += [MinPLogitsWarper(min_p)] if min_p else []
    for seed in range(3):
        logits = _random_logits(seed, vocab=300)
        input_ids: Any = torch.tensor([prompt + output])  # HF annotates a LongTensor
        scores = LogitsProcessorList(hf_chain)(input_ids, logits[None].clone())
        expected = torch.softmax(scores[0], 0)
        got = RequestSampler(params, prompt).probabilities(logits, output)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)


def test_min_p_drops_tokens_below_a_fraction_of_the_best() -> None:
    logits = torch.log(_logits(0.5, 0.3, 0.1, 0.06, 0.04))  # min_p 0.25 -> threshold 0.125
    drawn = set(_draws(RequestSampler(SamplingParams(min_p=0.25, seed=0), []), logits, 400))
    assert drawn == {0, 1}


def test_sampled_frequencies_match_softmax_of_logits_over_temperature() -> None:
    logits = _logits(1.0, 0.5, 0.0, -0.5, 2.0)
    temperature, draws = 0.7, 4000
    sampler = RequestSampler(SamplingParams(temperature=temperature, seed=1234), [])
    counts = torch.bincount(torch.tensor(_draws(sampler, logits, draws)), minlength=V).double()
    expected = torch.softmax(logits.double() / temperature, 0) * draws
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square < 18.47  # 4 degrees of freedom, p = 0.001


def test_repetition_penalty_applies_to_prompt_and_output_tokens() -> None:
    logits = _logits(2.0, 1.9, 1.8, -1.0, -1.0)
    greedy = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    assert RequestSampler(greedy, prompt_ids=[0]).sample(logits, []).token_id == 1  # 2.0/1.2 < 1.9
    assert RequestSampler(greedy, prompt_ids=[]).sample(logits, [0, 1]).token_id == 2
    assert RequestSampler(greedy.with_defaults({}), []).sample(logits, []).token_id == 0


def test_repetition_penalty_pushes_negative_logits_further_down() -> None:
    logits = _logits(-1.0, -1.1, -5.0, -5.0, -5.0)  # -1.0 * 1.2 = -1.2 < -1.1
    sampler = RequestSampler(SamplingParams(temperature=0.0, repetition_penalty=1.2), [0])
    assert sampler.sample(logits, []).token_id == 1


def test_presence_and_frequency_penalties_count_output_tokens_only() -> None:
    logits = _logits(3.0, 2.5, 0.0, 0.0, 0.0)
    presence = RequestSampler(SamplingParams(temperature=0.0, presence_penalty=1.0), prompt_ids=[1, 1])
    assert presence.sample(logits, []).token_id == 0
    assert presence.sample(logits, [0]).token_id == 1  # 3.0 - 1.0 < 2.5
    frequency = SamplingParams(temperature=0.0, frequency_penalty=0.3)
    assert RequestSampler(frequency, []).sample(logits, [0]).token_id == 0  # 2.7 > 2.5
    assert RequestSampler(frequency, []).sample(logits, [0, 0]).token_id == 1  # 2.4 < 2.5


def test_logprobs_are_the_raw_log_softmax_and_the_top_list_is_sorted() -> None:
    logits = _random_logits(4)
    params = SamplingParams(temperature=0.5, repetition_penalty=1.5, logprobs=5, seed=0)
    result = RequestSampler(params, prompt_ids=[1, 2, 3]).sample(logits, [4])
    reference = torch.log_softmax(logits.double(), 0)
    assert result.logprob == pytest.approx(float(reference[result.token_id]), abs=1e-5)
    assert result.top_logprobs is not None and len(result.top_logprobs) == 5
    top_ids = [token_id for token_id, _ in result.top_logprobs]
    assert top_ids == reference.topk(5).indices.tolist()
    for token_id, logprob in result.top_logprobs:
        assert logprob == pytest.approx(float(reference[token_id]), abs=1e-5)


def test_logprobs_none_and_zero() -> None:
    logits = _random_logits(5)
    assert RequestSampler(SamplingParams(seed=0), []).sample(logits, [])[1:] == (None, None)
    assert RequestSampler(SamplingParams(logprobs=0, seed=0), []).sample(logits, []).top_logprobs == []


def test_sampling_leaves_the_callers_logits_alone() -> None:
    logits = _random_logits(6)
    before = logits.clone()
    params = SamplingParams(repetition_penalty=1.3, frequency_penalty=1.0, top_p=0.9, seed=0)
    RequestSampler(params, [1, 2]).sample(logits, [3, 3])
    assert torch.equal(logits, before)


def test_sample_batch_checks_shapes() -> None:
    with pytest.raises(ValueError, match=r"logits \[N, V\]"):
        sample_batch([RequestSampler(SamplingParams(), [])], torch.zeros(2, V), [[], []])
    rows = sample_batch([RequestSampler(SamplingParams(temperature=0.0), [])], _logits(0, 3, 1, 0, 0)[None], [[]])
    assert rows == [SampleResult(1, None, None)]


# --- stopping ------------------------------------------------------------------------------------


def _stream(checker: StopChecker, pieces: list[str]) -> list[str]:
    out = []
    for i, piece in enumerate(pieces):
        out.append(checker.push(piece, token_id=100 + i))
        if checker.finish_reason:
            break
    return out


def test_a_stop_string_split_across_pieces_is_held_back_and_cut() -> None:
    checker = StopChecker(stop_strings=["</answer>"])
    emitted = _stream(checker, ["The answer is 4", "</an", "swer>", " trailing"])
    assert emitted == ["The answer is 4", "", ""]
    assert (checker.finish_reason, checker.stop_reason, checker.text) == (
        "stop",
        "</answer>",
        "The answer is 4",
    )


def test_held_text_is_released_when_it_turns_out_not_to_be_a_stop() -> None:
    checker = StopChecker(stop_strings=["STOP"])
    assert checker.push("go ST") == "go "
    assert checker.push("AR") == "STAR"
    assert checker.push("S", token_id=1) == ""  # "S" may start "STOP"
    assert checker.flush() == "S"
    assert checker.text == "go STARS" and checker.finish_reason is None


def test_the_earliest_stop_string_wins_and_text_after_it_is_dropped() -> None:
    checker = StopChecker(stop_strings=["world", "lo w"])
    assert checker.push("hello world, bye") == "hel"
    assert checker.stop_reason == "lo w"


def test_stop_and_eos_tokens_finish_without_their_text() -> None:
    checker = StopChecker(stop_strings=["<x>"], stop_token_ids=[7], eos_ids=[2])
    assert checker.push("a<", token_id=10) == "a"
    assert checker.push("<|im_end|>", token_id=2) == "<"  # held text released, EOS text not
    assert (checker.finish_reason, checker.stop_reason, checker.text) == ("stop", 2, "a<")
    checker = StopChecker(stop_token_ids=[7], eos_ids=[2])
    checker.push("b", token_id=7)
    assert (checker.finish_reason, checker.stop_reason, checker.text) == ("stop", 7, "")


def test_ignore_eos_keeps_going_but_stop_token_ids_still_stop() -> None:
    checker = StopChecker(stop_token_ids=[7], eos_ids=[2], ignore_eos=True)
    assert checker.push("x", token_id=2) == "x" and checker.finish_reason is None
    checker.push("y", token_id=7)
    assert checker.finish_reason == "stop"


def test_length_finish_releases_held_text() -> None:
    checker = StopChecker.from_params(SamplingParams(max_tokens=2, stop=("END",)), eos_ids=[0])
    assert checker.push("a", token_id=5) == "a"
    assert checker.push("EN", token_id=6) == "EN"
    assert (checker.finish_reason, checker.text) == ("length", "aEN")
    with pytest.raises(RuntimeError):
        checker.push("D", token_id=7)


def test_flush_cuts_a_stop_string_completed_by_the_tail() -> None:
    checker = StopChecker(stop_strings=["ab"])
    assert checker.push("xa", token_id=1) == "x"
    assert checker.flush("bc") == ""
    assert (checker.finish_reason, checker.text) == ("stop", "x")
