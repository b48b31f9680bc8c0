"""Train the default model's multi-token-prediction (MTP) block, the base model frozen, on one CPU core.

    .venv/bin/python scripts/train_mtp.py                    # both hidden inputs, then ship the better
    .venv/bin/python scripts/train_mtp.py --hidden post_norm --steps 50 --no-export   # a pilot

1. Data: the default model's training stream (`train_default_model.py` rebuilds the corpus from
   Debian's python3.11-doc and tokenizes it with the shipped tokenizer) and its windows of 256 tokens.
2. Training, teacher-forced and without the cache: the frozen base runs each window once (no
   gradients) and gives its hidden states h_i (after its final norm, or before it: `--hidden`);
   the MTP block (`hybridkv.models.mtp.MTPBlock`, the module inference runs) sees the rows
   (h_i, t_{i+1}) at RoPE position i with causal attention over them and learns t_{i+2} through
   the base's head. It starts from the base's attention layer (a warm start), fc random.
3. Acceptance on the held-out split, through the cache as speculation runs it: greedy decoding
   from held-out prompts with `CachedModel.draft_mtp` at every step; draft j counts as accepted
   when drafts 1..j all equal the tokens greedy decoding then produces.
4. Export: the `mtp.*` tensors (checkpoint names, per-expert, float32) added to the shipped
   model.safetensors, `num_nextn_predict_layers: 1` in config.json; checked that the main
   weights are unchanged and that transformers still loads the checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import train_default_model as base_training
from safetensors.torch import load_file, save_file

from hybridkv import CacheConfig, CachedModel
from hybridkv.models import Qwen3NextModel, load_model
from hybridkv.models.mtp import MTPHidden, mtp_layout
from hybridkv.ops.matmul import linear

OUT_DIR = base_training.OUT_DIR
HELDOUT_FILE = base_training.HELDOUT_FILE
SEQ_LEN = base_training.SEQ_LEN
SEED = 1
K = 4  # draft positions measured


class MTPRelayout(base_training.Relayout):
    """Our MTP parameters ⇄ the checkpoint's `mtp.*` tensors (per-expert layout)."""

    @staticmethod
    def _layout(model: Qwen3NextModel, names: set[str]) -> dict[str, list]:
        return mtp_layout(model.config, names)


def build(hidden: MTPHidden) -> tuple[Qwen3NextModel, MTPRelayout]:
    """The shipped base (frozen) with an MTP block, warm-started from the base's attention layer."""
    base = load_model(OUT_DIR)
    config = dataclasses.replace(base.config, mtp_num_hidden_layers=1)
    model = Qwen3NextModel(config, mtp=hidden)
    model.load_state_dict(base.state_dict(), strict=False)
    relayout = MTPRelayout(model)
    shipped = load_file(OUT_DIR / "model.safetensors")
    a = f"model.layers.{config.attention_layers[-1]}."
    gen = torch.Generator().manual_seed(SEED)
    init = {}
    for name, shape in relayout.shapes.items():
        twin = name.replace("mtp.layers.0.", a)
        if twin in shipped:
            init[name] = shipped[twin].clone()
        elif name == "mtp.fc.weight":
            init[name] = torch.randn(shape, generator=gen) * 0.02
        else:  # pre_fc norms and mtp.norm: identity (zero-centred)
            init[name] = torch.zeros(shape)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in relayout.from_checkpoint(init).items():
            if name.startswith("mtp."):  # the rest of the relayout's output is unset
                params[name].copy_(value)
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith("mtp."))
    return model, relayout


def base_hidden(model: Qwen3NextModel, windows: torch.Tensor) -> torch.Tensor:
    """The frozen base's hidden states [N, L, D] of windows [N, L], the kind its MTP block takes."""
    assert model.mtp is not None
    N, L = windows.shape
    seen: dict[str, torch.Tensor] = {}
    hook = model.norm.register_forward_hook(lambda m, args, out: seen.update(pre=args[0], post=out))
    mtp, model.mtp = model.mtp, None  # the plain forward (no cache to catch up)
    try:
        with torch.inference_mode():
            model(windows.flatten(), base_training.fresh_batch(model.config, N, L))
    finally:
        model.mtp = mtp
        hook.remove()
    return seen["post" if mtp.hidden == "post_norm" else "pre"].view(N, L, -1).clone()


def mtp_loss(model: Qwen3NextModel, windows: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of t_{i+2} from rows (h_i, t_{i+1}), i = 0..L-3, causal within a window."""
    mtp = model.mtp
    assert mtp is not None
    N, L = windows.shape
    T = L - 2
    hidden = base_hidden(model, windows)[:, :T].flatten(0, 1)
    embeds = model.embed_tokens(windows[:, 1 : T + 1].flatten())
    cos, sin = model.rope(torch.arange(T).repeat(N), torch.float32)
    x = mtp.fuse(embeds, hidden)
    q, gate, k, v = mtp.attn.split_heads(linear(mtp.input_norm(x), mtp.attn.qkv_proj), cos, sin)
    group = mtp.attn.H // mtp.attn.Hkv

    def heads(t: torch.Tensor) -> torch.Tensor:  # [N·T, h, hd] -> [N, h, T, hd]
        return t.view(N, T, *t.shape[1:]).transpose(1, 2)

    o = F.scaled_dot_product_attention(
        heads(q), heads(k).repeat_interleave(group, 1), heads(v).repeat_interleave(group, 1), is_causal=True
    )
    normed, _ = mtp.finish(x, o.transpose(1, 2).flatten(0, 1), gate)
    return F.cross_entropy(model.head(normed), windows[:, 2:].flatten())


def train(args: argparse.Namespace, hidden: MTPHidden) -> dict[str, torch.Tensor]:
    """Train one MTP block; returns its tensors under checkpoint names (cached in --work)."""
    done = args.work / f"mtp-{hidden}-{args.steps}.safetensors"
    if done.is_file():
        return load_file(done)
    stream = base_training.token_stream(args.work)
    model, relayout = build(hidden)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    log(f"{hidden}: {sum(p.numel() for p in params) / 1e6:.2f}M MTP parameters, {args.steps} steps")
    started, losses = time.monotonic(), []
    for step in range(args.steps):
        warm = min(1.0, (step + 1) / args.warmup)
        cosine = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in optimizer.param_groups:
            group["lr"] = args.lr * warm * cosine
        # Windows the base never saw in this order: offset past the base's first epoch.
        loss = mtp_loss(model, base_training.batch_windows(stream, 10_000 + step, args.batch))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % 10 == 0:
            per_step = (time.monotonic() - started) / (step + 1)
            log(f"{hidden} step {step + 1}: loss {sum(losses) / len(losses):.3f} ({per_step:.2f}s/step)")
            losses = []
    tensors = relayout.to_checkpoint(dict(model.named_parameters()))
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(done))
    return tensors


def acceptance(
    cm: CachedModel, prompts: list[list[int]], new_tokens: int, k: int = K
) -> tuple[list[float], list[float]]:
    """Greedy decoding from `prompts` (one batch), drafting k tokens with the MTP block before
    every step. Returns per draft position j = 1..k: the share of steps whose drafts 1..j all
    equal the greedy tokens that followed, and that share given drafts 1..j-1 were accepted."""
    seqs = [cm.new_sequence() for _ in prompts]
    last = cm.feed(dict(zip(seqs, prompts, strict=True)), logits="last")
    pending = {seq: int(last[seq][-1].argmax()) for seq in seqs}
    drafts: dict[int, list[list[int]]] = {seq: [] for seq in seqs}
    produced: dict[int, list[int]] = {seq: [pending[seq]] for seq in seqs}
    for _ in range(new_tokens):
        for seq, d in cm.draft_mtp(pending, k).items():
            drafts[seq].append(d)
        last = cm.feed({seq: [t] for seq, t in pending.items()}, logits="last")
        pending = {seq: int(last[seq][-1].argmax()) for seq in seqs}
        for seq, t in pending.items():
            produced[seq].append(t)
    hits = [0] * (k + 1)  # hits[j]: steps with drafts 1..j accepted (hits[0]: all steps)
    for seq in seqs:
        for m, d in enumerate(drafts[seq][: new_tokens - k]):  # steps whose k followers are known
            hits[0] += 1
            for j in range(k):
                if d[j] != produced[seq][m + 1 + j]:
                    break
                hits[j + 1] += 1
        cm.release(seq)
    cumulative = [hits[j] / hits[0] for j in range(1, k + 1)]
    conditional = [hits[j] / max(hits[j - 1], 1) for j in range(1, k + 1)]
    return cumulative, conditional


def heldout_prompts(count: int, length: int) -> list[list[int]]:
    """Prompts: the first `length` tokens of `count` consecutive held-out windows of SEQ_LEN."""
    from hybridkv.engine.tokenizer import Tokenizer

    ids = Tokenizer.from_dir(OUT_DIR).encode(HELDOUT_FILE.read_text())
    return [ids[i * SEQ_LEN : i * SEQ_LEN + length] for i in range(count)]


def measure(model_dir: Path, hidden: MTPHidden, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    cache = CacheConfig(max_model_len=args.prompt_len + args.new_tokens + 1, max_sequences=args.prompts)
    cm = CachedModel.load(model_dir, cache=cache, mtp=True, mtp_hidden=hidden)
    return acceptance(cm, heldout_prompts(args.prompts, args.prompt_len), args.new_tokens)


def write_checkpoint(directory: Path, mtp: dict[str, torch.Tensor]) -> None:
    """The shipped model's files in `directory` with `mtp` added (main tensors byte-identical)."""
    directory.mkdir(parents=True, exist_ok=True)
    for file in OUT_DIR.iterdir():
        if file.name != "model.safetensors" and directory != OUT_DIR:
            shutil.copy(file, directory / file.name)
    tensors = main_tensors() | {n: t.float().contiguous() for n, t in mtp.items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "model.safetensors").chmod(0o644)
    config = json.loads((OUT_DIR / "config.json").read_text()) | {"num_nextn_predict_layers": 1}
    base_training.write_json(directory / "config.json", config)


def main_tensors() -> dict[str, torch.Tensor]:
    """The shipped model's main weights (everything but `mtp.*`)."""
    return {n: t for n, t in load_file(OUT_DIR / "model.safetensors").items() if not n.startswith("mtp.")}


def check_export(directory: Path, main: dict[str, torch.Tensor]) -> None:
    """The main weights are `main`, and transformers still loads the checkpoint."""
    import transformers

    ours = load_file(directory / "model.safetensors")
    assert {n for n in ours if not n.startswith("mtp.")} == set(main)
    for name, tensor in main.items():
        assert torch.equal(ours[name], tensor), name
    hf = transformers.Qwen3NextForCausalLM.from_pretrained(directory).eval()
    assert not any(n.startswith("mtp.") for n in hf.state_dict())
    extra = sum(t.nbytes for n, t in ours.items() if n.startswith("mtp."))
    log(f"export checked: main tensors unchanged, transformers loads it; mtp.* adds {extra / 1e6:.2f} MB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "hybridkv" / "train-default-model")
    parser.add_argument("--hidden", choices=["post_norm", "pre_norm", "both"], default="both")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts for the acceptance figure")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=68)
    parser.add_argument("--no-export", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    if not (args.work / "train.json").is_file():
        base_training.prepare_corpus(args.work)
    if not (args.work / "tokenizer.json").is_file():  # the shipped tokenizer, not a new one
        shutil.copy(OUT_DIR / "tokenizer.json", args.work / "tokenizer.json")
    variants: list[MTPHidden] = ["post_norm", "pre_norm"] if args.hidden == "both" else [args.hidden]
    results = {}
    for hidden in variants:
        tensors = train(args, hidden)
        trial = args.work / f"model-{hidden}"
        write_checkpoint(trial, tensors)
        cumulative, conditional = measure(trial, hidden, args)
        results[hidden] = (tensors, cumulative)
        log(f"{hidden}: accepted drafts 1..j {[round(a, 3) for a in cumulative]}")
        log(f"{hidden}: draft j given 1..j-1 {[round(a, 3) for a in conditional]}")
        log(f"{hidden}: mean accepted per step {sum(cumulative):.3f} of {K}")
    if args.no_export:
        return
    best = max(results, key=lambda h: sum(results[h][1]))
    if best != "post_norm":
        log(f"{best} measured better, but the shipped block follows the released checkpoints (post_norm)")
    main = main_tensors()
    write_checkpoint(OUT_DIR, results["post_norm"][0])
    check_export(OUT_DIR, main)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
