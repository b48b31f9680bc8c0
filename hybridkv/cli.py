"""The `hybridkv` command.

    hybridkv generate PROMPT [--model MODEL] [--max-tokens N] [--temperature T] [--seed S] ...

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

from hybridkv.cache.config import KV_DTYPES, BudgetTooSmall
from hybridkv.engine.speculative import DRAFT_BUDGET, SPEC_METHODS, SpeculativeConfig
from hybridkv.errors import NotSupported
from hybridkv.models.sources import resolve_model
from hybridkv.models.weights import InsufficientMemory, format_bytes
from hybridkv.ops.quant.quantize import QUANTIZE_TYPES

if TYPE_CHECKING:
    from hybridkv.engine.llm import LLM
    from hybridkv.engine.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TEMPERATURE_HELP = (
    "0 = greedy (default: as the model's generation_config.json says, as in the server: greedy for the default "
    "model; its top_k, top_p and min_p apply too)"
)


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
    gen.add_argument("--max-tokens", type=int, default=64, metavar="N", help="tokens to generate at most (default 64)")
    gen.add_argument("--temperature", type=float, metavar="T", help=TEMPERATURE_HELP)
    gen.add_argument("--seed", type=int, metavar="S", help="sampling seed (default: random)")
    add_engine_flags(gen, max_num_seqs=1)
    gen.set_defaults(run=_generate)

    run = commands.add_parser(
        "run",
        help="chat with a model",
        description="Chat with a model: with PROMPT, stream one answer; without, an interactive chat "
        "(/reset, /regenerate, /think on|off, /stats, /quit; Ctrl-C stops a reply). A thinking model's "
        "reasoning is shown apart from its answer (dimmed on a terminal). Per turn, stderr shows how many "
        "prompt tokens came from the cache and how many were computed.",
    )
    run.add_argument("prompt", nargs="?", metavar="PROMPT", help="one message to answer, then exit")
    run.add_argument("--max-tokens", type=int, default=512, metavar="N", help="tokens per answer at most (default 512)")
    run.add_argument("--temperature", type=float, metavar="T", help=TEMPERATURE_HELP)
    run.add_argument("--seed", type=int, metavar="S", help="sampling seed (default: random)")
    run.add_argument("--system", metavar="TEXT", help="a system message opening the conversation")
    run.add_argument(
        "--think",
        action=argparse.BooleanOptionalAction,
        help="let a thinking model reason before it answers, or not (the template's enable_thinking; "
        "default: the template's own)",
    )
    run.add_argument("--hide-thinking", action="store_true", help="print only the answer, not the reasoning")
    add_engine_flags(run)
    add_disk_flags(run)
    run.set_defaults(run=_run_chat)

    from hybridkv import bench  # light: it imports its heavy parts (transformers, rich) when run

    bench.add_parser(commands)
    from hybridkv.server import cli as server_cli  # light: uvicorn and the model load when it runs

    server_cli.add_parser(commands)
    from hybridkv import quantize_command  # light: the writer is imported when it runs

    quantize_command.add_parser(commands)
    from hybridkv import cache_cli

    cache_cli.add_parser(commands)
    return parser


def add_engine_flags(parser: argparse.ArgumentParser, max_num_seqs: int = 8) -> None:
    """The flags every engine-backed command shares (run, serve)."""
    parser.add_argument(
        "--model",
        metavar="MODEL",
        help="a Qwen3-Next or Qwen3.5/3.6 model on this machine: a checkpoint directory, a .gguf file, an ollama "
        "name (qwen3.5:4b) or a Hugging Face repo id in the HF cache (Qwen/Qwen3.5-0.8B[@revision]); never "
        "downloaded (default: the shipped tiny Qwen3-Next)",
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="compute dtype (default float32)")
    parser.add_argument(
        "--quantize",
        choices=sorted(QUANTIZE_TYPES),
        help="quantize a float model's weights at load into GGUF blocks, computed on as a GGUF file's (default: as "
        "stored)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help=f"CPU threads (default: as many of the {torch.get_num_threads()} torch would use as other processes "
        "leave idle, looked at every half second: on a busy machine more threads only wait for each other)",
    )
    parser.add_argument("--max-model-len", type=int, default=4096, metavar="N", help="context length (default 4096)")
    parser.add_argument(
        "--cache-memory",
        metavar="SIZE",
        help="cache budget, e.g. 2GiB or 512MiB: 70%% KV blocks, 30%% snapshots (default: sized for --max-num-seqs "
        "sequences of --max-model-len tokens, shrunk to fit in half of the memory the weights leave)",
    )
    parser.add_argument(
        "--kv-dtype",
        choices=list(KV_DTYPES),
        help="what the attention K/V cache is stored in: float16 or bfloat16 hold twice the tokens in the same "
        "memory and read half the bytes a step, float16 as llama.cpp's default cache (default: --dtype)",
    )
    parser.add_argument(
        "--snapshot-interval", type=int, default=256, metavar="N", help="snapshot every N tokens (default 256)"
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=max_num_seqs,
        metavar="N",
        help=f"sequences decoding at once ({max_num_seqs})",
    )
    add_speculative_flags(parser)


def add_speculative_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--speculative",
        choices=SPEC_METHODS,
        default="off",
        help="speculative decoding, exact (the output is what plain decoding gives): ngram = prompt lookup, mtp = "
        "the model's multi-token-prediction block, auto = ngram drafting fewer tokens or none where drafts fail "
        "(default off)",
    )
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        metavar="K",
        help="tokens drafted and verified per sequence and step at most (default: 16 for ngram and auto, 4 for mtp)",
    )
    parser.add_argument(
        "--speculative-budget",
        type=int,
        default=DRAFT_BUDGET,
        metavar="N",
        help="drafted tokens one step verifies in all, shared by the sequences drafting in it: each of n drafts at "
        f"most N/n (default {DRAFT_BUDGET})",
    )


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig:
    try:
        return SpeculativeConfig(args.speculative, args.num_speculative_tokens, draft_budget=args.speculative_budget)
    except ValueError as e:
        message = str(e).replace("num_speculative_tokens", "--num-speculative-tokens")
        raise UsageError(message.replace("speculative draft_budget", "--speculative-budget")) from None


def add_disk_flags(parser: argparse.ArgumentParser) -> None:
    """The prefix cache's disk tier (run, serve): on by default."""
    parser.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="keep cached prompts (K/V blocks and recurrent states) on disk here, across restarts (default: "
        "$XDG_CACHE_HOME/hybridkv/prefix, else ~/.cache/hybridkv/prefix; created 0700)",
    )
    parser.add_argument(
        "--cache-disk",
        metavar="SIZE",
        default=os.environ.get(DISK_ENV),
        help=f"disk budget of the prefix cache, e.g. 20GiB; 0 turns it off (default: ${DISK_ENV}, else min(10%% of "
        "the free disk, 20 GiB))",
    )


DISK_ENV = "HYBRIDKV_CACHE_DISK"
_SIZE_UNITS = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}


def parse_size(text: str, flag: str = "--cache-memory") -> int:
    """Bytes from "2GiB", "512MiB", "1.5GB" or a plain number."""
    number, scale = text.strip().upper(), 1
    for unit, factor in _SIZE_UNITS.items():  # longer suffixes first: "GIB" before "B"
        if number.endswith(unit):
            number, scale = number[: -len(unit)], factor
            break
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise UsageError(f"{flag} {text!r}: give bytes or a size like 512MiB or 2GiB")
    return int(value * scale)


def kv_dtype_flag(args: argparse.Namespace) -> torch.dtype | None:
    """--kv-dtype as a dtype (None: not given, the compute dtype)."""
    return KV_DTYPES[args.kv_dtype] if args.kv_dtype else None


def llm_from_args(args: argparse.Namespace) -> LLM:
    """Build the LLM that `run` and `serve` drive, from the shared flags."""
    from hybridkv.engine.disk_store import default_cache_dir
    from hybridkv.engine.engine import EngineConfig
    from hybridkv.engine.llm import LLM, default_cache_config  # noqa: F811 (lazy: torch loads slowly)

    for flag in ("max_model_len", "max_num_seqs", "threads"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1")
    if args.snapshot_interval < 0:
        raise UsageError("--snapshot-interval must be >= 0 (0 turns interval snapshots off)")
    if args.threads:
        torch.set_num_threads(args.threads)
    source = resolve_model(args.model) if args.model else None
    engine = EngineConfig(
        max_num_seqs=args.max_num_seqs,
        adapt_threads=args.threads is None,
        speculative=speculative_config(args),
        **({"max_queue": args.max_queue} if "max_queue" in args else {}),
    )
    budget = parse_size(args.cache_memory) if args.cache_memory else None
    cache = default_cache_config(
        engine,
        max_model_len=args.max_model_len,
        snapshot_interval=args.snapshot_interval,
        kv_dtype=kv_dtype_flag(args),
        kv_bytes=None if budget is None else budget * 7 // 10,
        snapshot_bytes=None if budget is None else budget * 3 // 10,
    )
    cache_dir, cache_disk = None, None
    if "cache_disk" in args:  # run and serve: the disk tier is on unless --cache-disk 0
        off = args.cache_disk is not None and args.cache_disk.strip() in ("0", "0B")
        cache_dir = args.cache_dir or default_cache_dir()
        cache_disk = 0 if off else parse_size(args.cache_disk, "--cache-disk") if args.cache_disk else None
    try:
        return LLM(
            source,
            dtype=args.dtype,
            cache=cache,
            engine=engine,
            quantize=args.quantize,
            cache_dir=cache_dir,
            cache_disk=cache_disk,
            memory=getattr(args, "memory_share", None),
        )
    except BudgetTooSmall as e:
        raise UsageError(_budget_message(args, e)) from None
    except InsufficientMemory as e:
        replicas = " or run fewer --replicas (or --no-spare)," if getattr(args, "memory_share", None) else ""
        raise UsageError(
            f"{e.numbers}: lower --cache-memory (or --max-model-len, --max-num-seqs, which size the default "
            f"cache),{replicas} use --dtype bfloat16 or --quantize q8_0, or a machine with more memory"
        ) from None
    except (ValueError, MemoryError) as e:
        raise UsageError(str(e)) from None


def _budget_message(args: argparse.Namespace, error: BudgetTooSmall) -> str:
    """A cache budget too small for one sequence, in the flags that set it: --cache-memory gives
    70% to the KV blocks, so it needs `error.needed` / 0.7 (rounded up to a MiB)."""
    if error.field != "kv_bytes" or not args.cache_memory:
        return str(error)
    least = -(-error.needed * 10 // 7)
    mib = -(-least // (1 << 20))
    return (
        f"--cache-memory {args.cache_memory} is too small: one sequence of --max-model-len {args.max_model_len} "
        f"needs {format_bytes(error.needed)} of KV blocks, which get 70% of the budget: give --cache-memory "
        f"{mib}MiB or more, or lower --max-model-len"
    )


def _run_chat(args: argparse.Namespace) -> int:
    from hybridkv.chat import run_chat

    llm = llm_from_args(args)
    try:
        return run_chat(args, llm)
    finally:
        llm.close()  # the conversation's cache reaches the disk before the process ends


def _generate(args: argparse.Namespace) -> int:
    from hybridkv.default_model import default_model_dir
    from hybridkv.engine.sampling import SamplingParams
    from hybridkv.engine.tokenizer import Tokenizer

    if args.max_tokens < 1:
        raise UsageError("--max-tokens must be >= 1")
    if args.temperature is not None and args.temperature < 0:
        raise UsageError("--temperature must be >= 0")
    model_dir = resolve_model(args.model).path if args.model else default_model_dir()
    llm = None
    if model_dir.is_dir():  # checks the prompt before the (slow) model load
        try:
            tokenizer = Tokenizer.from_dir(model_dir)
            vocab_size = _model_vocab_size(model_dir, tokenizer)
        except ValueError as e:  # a corrupt tokenizer.json or config.json
            raise UsageError(str(e)) from None
    else:  # a GGUF file: the tokenizer comes with the model
        llm = _load_llm(args)
        tokenizer, vocab_size = llm.tokenizer, llm.cm.vocab_size
    prompt = _prompt_ids(args, tokenizer, vocab_size)
    if len(prompt) >= args.max_model_len:
        limit = args.max_model_len
        raise UsageError(f"the prompt has {len(prompt)} tokens: no room left in the context (--max-model-len {limit})")
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    except ValueError as e:
        raise UsageError(str(e)) from None

    started = time.perf_counter()
    llm = llm or _load_llm(args)
    _log(f"loaded {llm.source.description} ({args.dtype}) in {time.perf_counter() - started:.1f}s")
    started = time.perf_counter()
    generated, finish = 0, None
    for event in llm.stream(prompt, params):
        _write(event.text)
        generated += len(event.token_ids)
        finish = event.finish_reason or finish
    elapsed = time.perf_counter() - started
    if finish == "stop":
        why = "an end-of-sequence token"
    elif len(prompt) + generated >= args.max_model_len:
        why = "a full context (--max-model-len)"
    else:
        why = "--max-tokens"
    _log(f"\n{len(prompt)} prompt tokens, {generated} generated in {elapsed:.2f}s; stopped at {why}")
    return 0


def _load_llm(args: argparse.Namespace) -> LLM:
    return llm_from_args(args)


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
    try:
        config = json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    return int(vocab) if vocab else tokenizer.vocab_size


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
