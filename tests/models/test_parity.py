"""Our logits equal transformers' no-cache logits on the same weights, however the tokens are fed."""

from __future__ import annotations

import pytest
import torch
from tiny import TinyCache, hf_logits

from hybridkv.models import load_model

F32_TOL = 1e-4  # max |ours - transformers| as a share of max |logit|
BF16_MEAN_TOL, BF16_MAX_TOL = 2e-2, 1e-1  # transformers' own bf16 run errs as much, see the bf16 test

CONFIGS = {
    # Hv = 2·Hk, 1 attention layer in 4, MoE everywhere, untied (the tiny defaults)
    "default": {},
    # Hv = Hk, dk = dv, attention every 2nd layer, tied embeddings, un-normalised top-k
    "ratio1_tied": dict(
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        layer_types=["linear_attention", "full_attention"] * 2,
        tie_word_embeddings=True,
        norm_topk_prob=False,
    ),
    # dense MLP in layers 0 and 3, MoE only every 2nd layer, more experts, bigger heads, Hv = 4·Hk,
    # half-rotary RoPE, MHA (H = Hkv)
    "dense_layers": dict(
        mlp_only_layers=[0, 3],
        decoder_sparse_step=2,
        num_experts=8,
        num_experts_per_tok=3,
        head_dim=32,
        num_key_value_heads=4,
        linear_num_key_heads=1,
        linear_num_value_heads=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
        num_hidden_layers=5,
    ),
}


def assert_close(ours: torch.Tensor, ref: torch.Tensor, tol: float = F32_TOL) -> None:
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    err, scale = (ours - ref).abs().max().item(), ref.abs().max().item()
    assert err <= tol * scale, f"max |diff| {err:.3g} > {tol} × max |logit| {scale:.3g}"


def random_tokens(n: int, seed: int, vocab: int = 128) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", CONFIGS)
def test_batched_prefill_of_sequences_of_different_lengths_matches_transformers(make_checkpoint, name):
    hf, path = make_checkpoint(name, **CONFIGS[name])
    model = load_model(path)
    prompts = [random_tokens(n, seed=n) for n in (13, 1, 6)]
    cache = TinyCache(model.config, num_seqs=3, max_len=16)
    logits = cache.run(model, list(enumerate(prompts)))
    for ours, prompt in zip(logits, prompts, strict=True):
        assert_close(ours, hf_logits(hf, prompt))


def test_layer_mix_of_each_config_is_what_it_claims(make_checkpoint):
    """Guards the parity tests above: each kind of layer and feed-forward really occurs."""
    for name, overrides in CONFIGS.items():
        config = load_model(make_checkpoint(name, **overrides)[1]).config
        assert set(config.layer_kinds) == {"linear", "attention"}
    dense = load_model(make_checkpoint("dense_layers", **CONFIGS["dense_layers"])[1]).config
    assert set(dense.moe_layers) == {True, False}


def test_prefill_then_decode_matches_transformers(tiny_checkpoint):
    hf, path = tiny_checkpoint
    model = load_model(path)
    tokens = [random_tokens(14, seed=1), random_tokens(10, seed=2)]
    cache = TinyCache(model.config, num_seqs=2, max_len=16)
    # Prompts of 7 and 3 tokens, then both sequences decode together (different lengths).
    first = cache.run(model, [(0, tokens[0][:7]), (1, tokens[1][:3])])
    steps = [cache.run(model, [(0, [tokens[0][p]]), (1, [tokens[1][p - 4]])]) for p in range(7, 14)]
    for seq, prompt_len in ((0, 7), (1, 3)):
        ours = torch.cat([first[seq], *(step[seq] for step in steps)])
        assert_close(ours, hf_logits(hf, tokens[seq][: prompt_len + len(steps)]))


def test_prefill_in_chunks_mixed_with_decode_matches_transformers(tiny_checkpoint):
    hf, path = tiny_checkpoint
    model = load_model(path)
    long, short = random_tokens(15, seed=3), random_tokens(6, seed=4)
    ours_long, ours_short = chunks_mixed_with_decode(model, long, short)
    assert_close(ours_long, hf_logits(hf, long))
    assert_close(ours_short, hf_logits(hf, short))


def chunks_mixed_with_decode(model, long: list[int], short: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Our logits for `long` (15 tokens) fed in chunks of 5, 1, 4 and 5 while `short` (6) prefills 3
    then decodes in the same forwards: mixed batches of long and one-token feeds."""
    cache = TinyCache(model.config, num_seqs=2, max_len=16)
    outs: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    plan = [((0, 5), (1, 3)), ((0, 1), (1, 1)), ((0, 4), (1, 1)), ((0, 5), (1, 1))]
    for feeds in plan:
        chunk = [(seq, (long if seq == 0 else short)[cache.lens[seq] : cache.lens[seq] + n]) for seq, n in feeds]
        for (seq, _), logits in zip(feeds, cache.run(model, chunk), strict=True):
            outs[seq].append(logits)
    return torch.cat(outs[0]), torch.cat(outs[1])


def test_logits_indices_select_rows(tiny_checkpoint):
    _, path = tiny_checkpoint
    model = load_model(path)
    tokens = random_tokens(9, seed=5)
    full = TinyCache(model.config, 1, 16)
    everything = full.run(model, [(0, tokens)])[0]
    some = TinyCache(model.config, 1, 16)
    indices = torch.tensor([8, 2])
    picked = model(torch.tensor(tokens), some.batch([(0, 9)]), indices)
    torch.testing.assert_close(picked, everything[indices])


def test_snapshots_hold_the_state_after_their_token(tiny_checkpoint):
    """A snapshot taken inside a prefill, or in a decode step, equals the live state of a sequence
    that stopped at that token."""
    _, path = tiny_checkpoint
    model = load_model(path)
    tokens = random_tokens(12, seed=6)
    cache = TinyCache(model.config, num_seqs=3, max_len=16, num_snapshots=2)
    # Sequence 0: 10 tokens with a snapshot after token 5 (into row 1); sequence 1: the first 6 tokens.
    cache.run(model, [(0, tokens[:10]), (1, tokens[:6])], snapshot_at=[5], snapshot_ids=[1])
    # Sequence 2: 10 tokens, then a decode step of sequences 1 and 2 with a snapshot of sequence 2 (row 0).
    cache.run(model, [(2, tokens[:10])])
    cache.run(model, [(1, [tokens[6]]), (2, [tokens[10]])], snapshot_at=[1], snapshot_ids=[0])
    reference = TinyCache(model.config, num_seqs=2, max_len=16)
    reference.run(model, [(0, tokens[:6]), (1, tokens[:11])])
    t, ref = cache.tensors, reference.tensors
    for j in range(len(model.config.linear_layers)):
        for snap, seq in ((1, 0), (0, 1)):
            torch.testing.assert_close(t.snap_conv[j][snap], ref.conv[j][seq])
            torch.testing.assert_close(t.snap_delta[j][snap], ref.delta[j][seq], atol=1e-5, rtol=1e-4)
        # the live state of sequence 0 went on past the snapshot
        assert not torch.allclose(t.conv[j][0], ref.conv[j][0])


def test_bfloat16_compute_stays_close_to_transformers(make_checkpoint):
    """bf16 rounds every matmul to ~3 significant digits, and a near-tie in the router can then pick
    another expert for a token, so the bound is on the mean error, with a loose cap on the worst token."""
    hf, path = make_checkpoint("bf16", dtype=torch.bfloat16)  # also: a bf16 checkpoint loads
    model = load_model(path, torch.bfloat16)
    assert model.embed.dtype == torch.bfloat16
    assert model.layers[0].mixer.A_log.dtype == torch.float32  # kept in float32 like transformers does
    prompt = random_tokens(12, seed=7)
    cache = TinyCache(model.config, num_seqs=1, max_len=16, dtype=torch.bfloat16)
    prefill = cache.run(model, [(0, prompt[:9])])
    decode = [cache.run(model, [(0, [t])])[0] for t in prompt[9:]]
    ours = torch.cat([*prefill, *decode])
    for state in cache.tensors.conv + cache.tensors.delta:
        assert state.dtype == torch.float32

    truth = hf_logits(hf, prompt)  # float32 forward over the same (bf16-representable) weights
    hf_bf16 = hf_logits(hf.to(torch.bfloat16), prompt)
    hf.to(torch.float32)
    scale = truth.abs().max()
    assert ours.dtype == torch.float32
    assert (ours - truth).abs().mean() <= BF16_MEAN_TOL * scale
    assert (ours - truth).abs().max() <= BF16_MAX_TOL * scale
    assert (ours - hf_bf16).abs().mean() <= BF16_MEAN_TOL * scale
