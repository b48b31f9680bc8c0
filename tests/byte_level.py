"""Byte-level tokens for tests: GPT-2's byte alphabet, and a tokenizer whose token id is the byte value.

Byte-level BPE tokenizers (Qwen's, the default model's) have one token per byte, spelt in this
alphabet, so a test can feed exact bytes, half a UTF-8 character included.
"""

from __future__ import annotations

from hybridkv.engine.tokenizer import Tokenizer

NUM_BYTES = 256
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = range(NUM_BYTES, NUM_BYTES + len(SPECIAL_TOKENS))


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as a printable character (the ByteLevel convention)."""
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in visible}
    for b in range(NUM_BYTES):
        if b not in chars:  # unprintable bytes map past 255, in order
            chars[b] = NUM_BYTES + len(chars) - len(visible)
    return {b: chr(c) for b, c in sorted(chars.items())}


def byte_token_ids(tokenizer: Tokenizer, data: bytes) -> list[int]:
    """The ids of `data`'s single-byte tokens in a byte-level tokenizer, one per byte."""
    alphabet = byte_to_unicode()
    ids = [tokenizer.token_to_id(alphabet[b]) for b in data]
    assert None not in ids, "not a byte-level tokenizer"
    return [i for i in ids if i is not None]


def byte_tokenizer() -> Tokenizer:
    """Token id == byte value (no merges), then the three Qwen special tokens; eos <|im_end|>, <|endoftext|>."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    vocab = {char: b for b, char in byte_to_unicode().items()}
    backend = Backend(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return Tokenizer(backend, eos_token_ids=(IM_END_ID, ENDOFTEXT_ID))
