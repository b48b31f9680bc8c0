"""The `hybridkv` command.

    hybridkv generate PROMPT [--model DIR] [--max-tokens N] [--temperature T] [--seed S] ...

Only generated text goes to stdout (flushed piece by piece); logs go to stderr. A usage error
(an empty prompt, one longer than the context, a missing model) exits with status 2 and a
one-line message, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hybridkv.errors import NotSupported

if TYPE_CHECKING:
    from hybridkv import CachedModel
    from hybridkv.engine.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class UsageError(Exception):
    """A mistake in what the user asked for; reported in one line with exit status 2."""


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return int(args.run(args))
    except (UsageError, NotSupported, FileNotFoundError) as e:
        return _fail(str(e))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `| head`: the reader left; keep Python's exit flush quiet too
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybridkv", description="Inference engine for hybrid attention + linear-recurrence models."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = commands.add_parser(
        "generate",
        help="continue a prompt",
        description="Continue a prompt, streaming the new text to stdout.",
    )
    gen.add_argument("prompt", nargs="?", metavar="PROMPT", help="text to continue (or use --prompt-ids)")
    gen.add_argument("--prompt-ids", metavar="IDS", help='token ids instead of text, e.g. "1,2,3"')
    gen.add_argument("--model", metavar="DIR", help="checkpoint directory (default: a tiny random Qwen3-Next)")
    gen.add_argument("--max-tokens", type=int, default=64, metavar="N", help="tokens to generate at most (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    gen.add_argument("--seed", type=int, metavar="S", help="sampling seed (default: random)")
    gen.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="float32",
        help="weight and compute dtype (default float32)",
    )
    gen.add_argument("--threads", type=int, metavar="N", help="torch CPU threads")
    gen.add_argument(
        "--max-model-len",
        type=int,
        default=4096,
        metavar="N",
        help="context length: prompt + generated tokens (default 4096)",
    )
    gen.set_defaults(run=_generate)
    return parser


def _generate(args: argparse.Namespace) -> int:
    from hybridkv.default_model import default_model_dir
    from hybridkv.engine.tokenizer import IncrementalDecoder, Tokenizer

    if args.max_tokens < 1:
        raise UsageError("--max-tokens must be >= 1")
    if args.temperature < 0:
        raise UsageError("--temperature must be >= 0")
    if args.max_model_len < 1:
        raise UsageError("--max-model-len must be >= 1")
    if args.threads is not None:
        if args.threads < 1:
            raise UsageError("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else default_model_dir()
    if not model_dir.is_dir():
        raise UsageError(f"--model {model_dir}: no such directory")
    tokenizer = Tokenizer.from_dir(model_dir)
    prompt = _prompt_ids(args, tokenizer, _model_vocab_size(model_dir, tokenizer))
    if len(prompt) >= args.max_model_len:
        limit = args.max_model_len
        raise UsageError(f"the prompt has {len(prompt)} tokens: no room left in the context (--max-model-len {limit})")

    started = time.perf_counter()
    model = _load_model(model_dir, DTYPES[args.dtype], args.max_model_len)
    _log(f"loaded {model_dir} ({args.dtype}) in {time.perf_counter() - started:.1f}s")

    generator = torch.Generator()
    if args.seed is None:
        generator.seed()
    else:
        generator.manual_seed(args.seed)
    decoder = IncrementalDecoder(tokenizer, context=prompt)
    seq = model.new_sequence()
    started, generated, stop = time.perf_counter(), 0, "an end-of-sequence token"
    try:
        logits = model.feed({seq: prompt}, logits="last")[seq]
        while True:
            token = _sample(logits[-1], args.temperature, generator)
            if token in tokenizer.eos_token_ids:
                break
            generated += 1
            _write(decoder.push(token))
            if generated == args.max_tokens:
                stop = "--max-tokens"
                break
            if len(prompt) + generated == args.max_model_len:
                stop = "a full context (--max-model-len)"
                break
            logits = model.feed({seq: [token]}, logits="last")[seq]
        _write(decoder.flush())
    finally:
        model.release(seq)
    elapsed = time.perf_counter() - started
    _log(f"\n{len(prompt)} prompt tokens, {generated} generated in {elapsed:.2f}s; stopped at {stop}")
    return 0


def _prompt_ids(args: argparse.Namespace, tokenizer: Tokenizer, vocab_size: int) -> list[int]:
    if (args.prompt is None) == (args.prompt_ids is None):
        raise UsageError("give either PROMPT or --prompt-ids, not both or neither")
    if args.prompt_ids is None:
        ids = tokenizer.encode(args.prompt)
    else:
        try:
            ids = [int(part) for part in args.prompt_ids.split(",") if part.strip()]
        except ValueError:
            msg = f'--prompt-ids must be comma-separated integers like "1,2,3", got {args.prompt_ids!r}'
            raise UsageError(msg) from None
        if bad := [i for i in ids if not 0 <= i < vocab_size]:
            raise UsageError(f"--prompt-ids {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    if not ids:
        raise UsageError("the prompt is empty")
    return ids


def _model_vocab_size(model_dir: Path, tokenizer: Tokenizer) -> int:
    """The model's vocabulary (often padded past the tokenizer's), from config.json when it says."""
    path = model_dir / "config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    return int(vocab) if vocab else tokenizer.vocab_size


def _load_model(model_dir: Path, dtype: torch.dtype, max_model_len: int) -> CachedModel:
    from hybridkv import CacheConfig, CachedModel

    # One sequence: size the cache for it alone, not for a server's worth.
    cache = CacheConfig(max_model_len=max_model_len, max_sequences=1)
    return CachedModel.load(model_dir, dtype=dtype, cache=cache)


def _sample(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> int:
    """Greedy at temperature 0, else a draw from softmax(logits / temperature). logits: [V]."""
    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def _write(text: str) -> None:
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _fail(message: str) -> int:
    print(f"hybridkv: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
