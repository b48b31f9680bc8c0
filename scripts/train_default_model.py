"""Train hybridkv's default model: a tiny Qwen3-Next on the Python documentation, on one CPU core.

    .venv/bin/pip install -e '.[test,train]'          # transformers (export check), matplotlib (plot)
    .venv/bin/python scripts/train_default_model.py   # about 35 minutes on one core
    .venv/bin/python scripts/train_default_model.py --max-minutes 5   # a pilot: stops, resumable

Every stage keeps its result in --work (default ~/.cache/hybridkv/train-default-model), so a
stopped run picks up where it was: the corpus and tokenizer are made once, training saves a
checkpoint every few minutes and resumes from it (the data order depends only on the step, so a
resumed run is the same run), and the export runs when the last step is done.

1. Corpus: the reStructuredText sources in Debian's `python3.11-doc` package (version
   DEB_VERSION), the Python 3.11 documentation, licensed under the PSF License Agreement (its
   code examples also under the Zero-Clause BSD license; see license.rst in the package). The
   sources are converted to plain text (rst_text.py); every HELDOUT_EVERY-th document (in sorted
   path order) is held out and shipped in tests/data/ for the perplexity test. A few sections of
   the training documents are also written as ChatML conversations, so the model knows the format.
2. Tokenizer: byte-level BPE (Qwen2's pre-tokenizer regex) trained on the training documents,
   plus the special tokens <|endoftext|> (document end, padding), <|im_start|> and <|im_end|>
   (ChatML turns; the end of a turn is the eos token).
3. Training: hybridkv's own Qwen3NextModel with gradients, AdamW, linear warm-up then cosine
   decay, from a fixed seed. The inference delta rule updates its state in place, which autograd
   cannot differentiate, so training swaps in an out-of-place twin (checked against it first),
   and the experts run one matmul pair each. Weights are initialised, checkpointed and exported
   under the released Hugging Face names, mapped to and from the model's own layout by probing
   `qwen3_next.checkpoint_layout` (`Relayout`), so nothing here knows that layout.
4. Export: the weights, checked by loading them into hybridkv (the trained parameters) and into
   transformers' Qwen3NextForCausalLM (the same logits); config, tokenizer files, the loss plot
   (docs/training_loss.png) and the held-out perplexity the README quotes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from rst_text import rst_labels, rst_to_text
from safetensors.torch import save_file

import hybridkv.models.qwen3_next as qwen3_next
from hybridkv import CacheConfig, CachedModel
from hybridkv.cache.batch import CacheTensors, ForwardBatch
from hybridkv.models import ModelConfig, Qwen3NextModel, load_model
from hybridkv.ops.delta_rule import chunk_gated_delta_rule
from hybridkv.server.chatml import CHATML_WITH_TOOLS

REPO = Path(__file__).resolve().parents[1]
OUT_DIR = REPO / "hybridkv" / "assets" / "default_model"
HELDOUT_FILE = REPO / "tests" / "data" / "default_model_heldout.txt"
PLOT_FILE = REPO / "docs" / "training_loss.png"

SEED = 0
DEB_PACKAGE, DEB_VERSION = "python3.11-doc", "3.11.2-6+deb12u8"
SOURCES = "usr/share/doc/python3.11/html/_sources"
# Prose-rich parts of the documentation; the C API, changelogs and deprecated distutils are left out.
PARTS = ("tutorial", "howto", "faq", "reference", "library", "extending", "using", "installing", "distributing")
HELDOUT_EVERY = 40
CHAT_SHARE = 0.5  # of the training sections with a prose first paragraph, also written as a chat
ASKS = ("Tell me about {}.", "What is {}?", "Explain {}.")

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VOCAB_SIZE = 4096
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = range(VOCAB_SIZE - len(SPECIAL_TOKENS), VOCAB_SIZE)  # after the BPE tokens
# Qwen2's pre-tokenizer split: words with one leading non-letter, single digits, punctuation runs.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2.5 / Qwen3 ChatML with tools: the template the server also falls back to.
CHAT_TEMPLATE = CHATML_WITH_TOOLS

LAYER_TYPES = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
CONFIG: dict[str, object] = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "dtype": "float32",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 192,
    "num_hidden_layers": len(LAYER_TYPES),
    "layer_types": LAYER_TYPES,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "attention_bias": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "moe_intermediate_size": 192,
    "shared_expert_intermediate_size": 192,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "intermediate_size": 512,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "bos_token_id": ENDOFTEXT_ID,
    "eos_token_id": IM_END_ID,
    "pad_token_id": ENDOFTEXT_ID,
}
MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's per-parameter state besides its step count

# How the README's held-out perplexity is measured (tests/test_default_model.py does the same):
# the first EVAL_TOKENS tokens of the held-out split, cut into windows of SEQ_LEN tokens, each
# a fresh sequence; every token but a window's first is predicted.
SEQ_LEN = 256
EVAL_TOKENS = 16384


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "hybridkv" / "train-default-model")
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps (the cosine schedule's length)")
    parser.add_argument("--batch", type=int, default=16, help="sequences of SEQ_LEN tokens per step")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=100, help="warm-up steps")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--max-minutes", type=float, help="stop (with a checkpoint) after this long: a pilot")
    parser.add_argument("--checkpoint-minutes", type=float, default=4.0)
    parser.add_argument("--eval-every", type=int, default=50, help="steps between held-out evaluations")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)

    if not (args.work / "train.json").is_file():
        prepare_corpus(args.work)
    if not (args.work / "tokenizer.json").is_file():
        train_tokenizer(args.work)
    if train(args) < args.steps:
        return
    export(args.work)


# -- 1. corpus ----------------------------------------------------------------------------------


def prepare_corpus(work: Path) -> None:
    """work/train.json (documents and chats) and work/heldout.txt (documents, each ending <|endoftext|>)."""
    deb = work / f"{DEB_PACKAGE}_{DEB_VERSION}_all.deb"
    if not deb.is_file():
        log(f"apt-get download {DEB_PACKAGE}={DEB_VERSION}")
        subprocess.run(["apt-get", "download", f"{DEB_PACKAGE}={DEB_VERSION}"], cwd=work, check=True)
    tree = work / "deb"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(tree)], check=True)
    root = tree / SOURCES
    files = sorted(p for part in PARTS for p in (root / part).rglob("*.rst.txt"))
    sources = {p.relative_to(root).as_posix(): p.read_text(encoding="utf-8") for p in files}
    labels: dict[str, str] = {}
    for source in sources.values():
        labels.update(rst_labels(source))

    rng = random.Random(SEED)
    documents, chats, heldout = [], [], []
    for i, source in enumerate(sources[name] for name in sorted(sources)):
        sections = rst_to_text(source, labels)
        text = "\n\n".join(f"{title}\n\n{body}" if title else body for title, body in sections).strip()
        if i % HELDOUT_EVERY == HELDOUT_EVERY // 2:
            heldout.append(text)
            continue
        documents.append(text)
        for title, body in sections:
            answer = _first_paragraphs(body)
            if title and answer and rng.random() < CHAT_SHARE:
                question = title if title.endswith("?") else rng.choice(ASKS).format(title)
                chats.append(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n")
    (work / "train.json").write_text(json.dumps({"documents": documents, "chats": chats}))
    held = "".join(doc + SPECIAL_TOKENS[0] for doc in heldout)
    (work / "heldout.txt").write_text(held)
    shutil.rmtree(tree)
    size = sum(len(d.encode()) for d in documents)
    log(f"corpus: {len(documents)} training documents ({size / 1e6:.1f} MB), {len(chats)} chats")
    log(f"held out: {len(heldout)} documents ({len(held.encode()) / 1e3:.0f} kB)")


def _first_paragraphs(body: str, limit: int = 700) -> str:
    """The section's opening prose paragraphs, up to about `limit` characters, that end a sentence
    ("" if it opens with code)."""
    out = []
    for paragraph in body.split("\n\n"):
        if not paragraph or paragraph[0] in " >" or "\n" in paragraph or sum(map(len, out)) + len(paragraph) > limit:
            break
        out.append(paragraph)
    while out and not out[-1].endswith("."):  # e.g. "as follows:" before a code block
        out.pop()
    return "\n\n".join(out)


# -- 2. tokenizer -------------------------------------------------------------------------------


def train_tokenizer(work: Path) -> None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    documents = json.loads((work / "train.json").read_text())["documents"]
    tokenizer.train_from_iterator(documents, trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [ENDOFTEXT_ID, IM_START_ID, IM_END_ID]
    tokenizer.save(str(work / "tokenizer.json"))
    log(f"tokenizer: {tokenizer.get_vocab_size()} tokens")


def load_tokenizer(work: Path):  # -> tokenizers.Tokenizer
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(work / "tokenizer.json"))


def token_stream(work: Path) -> torch.Tensor:
    """Training documents and chats in a seeded random order, each followed by <|endoftext|>: [n] int64."""
    path = work / "train_ids.pt"
    if path.is_file():
        return torch.load(path)
    corpus = json.loads((work / "train.json").read_text())
    texts = corpus["documents"] + corpus["chats"]
    random.Random(SEED).shuffle(texts)
    ids: list[int] = []
    for encoding in load_tokenizer(work).encode_batch(texts, add_special_tokens=False):
        ids += [*encoding.ids, ENDOFTEXT_ID]
    stream = torch.tensor(ids, dtype=torch.int64)
    torch.save(stream, path)
    text_bytes = sum(len(t.encode()) for t in texts)
    log(f"training stream: {len(ids)} tokens ({text_bytes / len(ids):.2f} bytes per token)")
    return stream


def heldout_windows(tokenizer, text: str) -> torch.Tensor:
    """The first EVAL_TOKENS held-out tokens as [EVAL_TOKENS / SEQ_LEN, SEQ_LEN] windows."""
    ids = tokenizer.encode(text, add_special_tokens=False).ids[:EVAL_TOKENS]
    assert len(ids) == EVAL_TOKENS, f"the held-out split has only {len(ids)} tokens"
    return torch.tensor(ids).view(-1, SEQ_LEN)


# -- 3. training --------------------------------------------------------------------------------


def fresh_batch(config: ModelConfig, num_seqs: int, seq_len: int) -> ForwardBatch:
    """A batch of `num_seqs` new sequences of `seq_len` tokens over pools of their own.

    Fresh pools each step: the model writes K/V and states into them, and autograd must not see
    one step's graph through the next step's pools.
    """
    c, N, L = config, num_seqs, seq_len
    block_size = 16
    blocks = N * -(-L // block_size)
    kv_shape = (blocks, block_size, c.num_key_value_heads, c.head_dim)
    conv_shape = (N, c.conv_channels, c.linear_conv_kernel_dim - 1)
    delta_shape = (N, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
    attention, linear = range(len(c.attention_layers)), range(len(c.linear_layers))
    tensors = CacheTensors(
        key=[torch.zeros(kv_shape) for _ in attention],
        value=[torch.zeros(kv_shape) for _ in attention],
        conv=[torch.zeros(conv_shape) for _ in linear],
        delta=[torch.zeros(delta_shape) for _ in linear],
        snap_conv=[torch.zeros(0, *conv_shape[1:]) for _ in linear],
        snap_delta=[torch.zeros(0, *delta_shape[1:]) for _ in linear],
    )
    none = torch.zeros(0, dtype=torch.int64)
    return ForwardBatch(
        seq_ids=tuple(range(N)),
        q_lens=(L,) * N,
        start_lens=(0,) * N,
        cu_seqlens=torch.arange(N + 1) * L,
        positions=torch.arange(L).repeat(N),
        block_tables=torch.arange(blocks).view(N, -1),  # sequence n owns a contiguous run of blocks
        kv_lens=torch.full((N,), L),
        slot_mapping=torch.arange(N * L),
        state_slots=torch.arange(N),
        snapshot_at=none,
        snapshot_ids=none,
        tensors=tensors,
    )


def differentiable_chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor,
    state_at: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`chunk_gated_delta_rule` for N sequences of one length and no snapshots, without in-place
    updates: the same chunked algorithm, the state carried out of place from chunk to chunk."""
    T, Hv, dk = k.shape
    dv, N, C = v.shape[-1], cu_seqlens.numel() - 1, chunk_size
    L = T // N
    assert torch.equal(cu_seqlens, torch.arange(N + 1) * L) and (state_at is None or state_at.numel() == 0)
    n = -(-L // C)

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [T, Hv, ...] -> [N, Hv, n, C, ...], zero-padded
        x = F.pad(x.float().reshape(N, L, Hv, -1), (0, 0, 0, 0, 0, n * C - L))
        return x.view(N, n, C, Hv, -1).permute(0, 3, 1, 2, 4)

    q_c, k_c, v_c = chunks(q), chunks(k), chunks(v)
    g_c, beta_c = chunks(g).squeeze(-1), chunks(beta).squeeze(-1)  # padding: g = 0, β = 0 (no effect)
    g_cum = g_c.cumsum(-1)
    causal = torch.ones(C, C, dtype=torch.bool).tril()
    decay = (g_cum[..., :, None] - g_cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k_c * beta_c[..., None]
    ut_system = (k_beta @ k_c.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(ut_system, v_c * beta_c[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(ut_system, k_beta * g_cum.exp()[..., None], upper=False, unitriangular=True)
    intra = (q_c @ k_c.transpose(-1, -2)) * decay
    q_decayed = q_c * g_cum.exp()[..., None]
    k_decayed_t = (k_c * (g_cum[..., -1:] - g_cum).exp()[..., None]).transpose(-1, -2)
    chunk_decay = g_cum[..., -1].exp()[..., None, None]
    state, outputs = initial_state.float(), []
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ state
        outputs.append(q_decayed[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k_decayed_t[:, :, i] @ v_new
    o = torch.stack(outputs, 2).reshape(N, Hv, n * C, dv)[:, :, :L].transpose(1, 2).reshape(T, Hv, dv)
    return o, state, torch.zeros(0, Hv, dk, dv)


def check_delta_rule_twin() -> None:
    """The twin computes what the inference op computes (outputs and final states)."""
    gen = torch.Generator().manual_seed(SEED)
    N, L, Hv, dk, dv = 3, 150, 4, 16, 8
    q, k = (F.normalize(torch.randn(N * L, Hv, dk, generator=gen), dim=-1) for _ in range(2))
    v, state = torch.randn(N * L, Hv, dv, generator=gen), torch.randn(N, Hv, dk, dv, generator=gen)
    g, beta = -torch.rand(N * L, Hv, generator=gen), torch.rand(N * L, Hv, generator=gen)
    args = (q, k, v, g, beta, torch.arange(N + 1) * L, state)
    for ours, real in zip(differentiable_chunk_gated_delta_rule(*args), chunk_gated_delta_rule(*args), strict=True):
        torch.testing.assert_close(ours, real)


@contextlib.contextmanager
def differentiable_ops() -> Iterator[None]:
    """Within: the model runs ops autograd can differentiate (the linear layers use the delta
    rule's out-of-place twin; the inference op updates its state in place)."""
    qwen3_next.chunk_gated_delta_rule = differentiable_chunk_gated_delta_rule
    try:
        yield
    finally:
        qwen3_next.chunk_gated_delta_rule = chunk_gated_delta_rule


def initial_checkpoint(relayout: Relayout, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Initial weights under checkpoint names, GPT-2 style: projections N(0, 0.02), output
    projections scaled by 1/sqrt(2·layers); norms at their identity (zero-centred ones w = 0, the
    gated norm w = 1); decays and gates as transformers initialises them."""
    gen = torch.Generator().manual_seed(SEED)
    out_std, kernel = 0.02 / math.sqrt(2 * config.num_hidden_layers), config.linear_conv_kernel_dim
    tensors = {}
    for name, shape in sorted(relayout.shapes.items()):
        if name.endswith(("linear_attn.norm.weight", "dt_bias")):
            tensors[name] = torch.ones(shape)
        elif name.endswith("norm.weight"):
            tensors[name] = torch.zeros(shape)
        elif name.endswith("A_log"):
            tensors[name] = torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()
        elif name.endswith("conv1d.weight"):
            tensors[name] = torch.empty(shape).uniform_(-(kernel**-0.5), kernel**-0.5, generator=gen)
        elif name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")):
            tensors[name] = torch.empty(shape).normal_(0.0, out_std, generator=gen)
        else:
            tensors[name] = torch.empty(shape).normal_(0.0, 0.02, generator=gen)
    return tensors


class Relayout:
    """Our parameters ⇄ tensors under checkpoint names, whatever layout the model keeps inside.

    `qwen3_next.checkpoint_layout` says how each checkpoint tensor is written into our parameters
    (copied into rows, columns or transposed views, zero-centred norms as 1 + w). Running each
    writer once on a tensor of element indices, and once on zeros, finds where every element goes
    and the offset it gets; both directions are then a gather. Moments of the optimizer, which
    follow the parameters element by element, move the same way without the offset.
    """

    def __init__(self, model: Qwen3NextModel) -> None:
        params = dict(model.named_parameters())
        self.param_shapes = {name: tuple(p.shape) for name, p in params.items()}
        self.shapes: dict[str, tuple[int, ...]] = {}
        # per piece: (checkpoint name, our parameter, flat positions in it, source element, offset)
        self.moves: list[tuple[str, str, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        names = {piece.name for pieces in self._layout(model, set()).values() for piece in pieces}
        for param, pieces in self._layout(model, names).items():
            for piece in pieces:
                n = math.prod(piece.shape)
                where = torch.full(params[param].shape, math.nan, dtype=torch.float64)
                piece.write(where, torch.zeros(piece.shape, dtype=torch.float64))
                offset = where.flatten().clone()
                positions = (~offset.isnan()).nonzero().squeeze(1)
                piece.write(where, torch.arange(n, dtype=torch.float64).view(piece.shape))
                source = where.flatten()[positions] - offset[positions]
                assert torch.equal(source.sort().values, torch.arange(n, dtype=torch.float64)), piece.name
                self.moves.append((piece.name, param, positions, source.long(), offset[positions].float()))
                self.shapes[piece.name] = piece.shape

    @staticmethod
    def _layout(model: Qwen3NextModel, names: set[str]) -> dict[str, list]:
        return qwen3_next.checkpoint_layout(model.config, names)

    def to_checkpoint(self, values: dict[str, torch.Tensor], offset: bool = True) -> dict[str, torch.Tensor]:
        out = {}
        for name, param, positions, source, shift in self.moves:
            flat = torch.empty(math.prod(self.shapes[name]))
            flat[source] = values[param].detach().flatten()[positions].float() - (shift if offset else 0.0)
            out[name] = flat.view(self.shapes[name])
        return out

    def from_checkpoint(self, tensors: dict[str, torch.Tensor], offset: bool = True) -> dict[str, torch.Tensor]:
        out = {name: torch.empty(math.prod(shape)) for name, shape in self.param_shapes.items()}
        for name, param, positions, source, shift in self.moves:
            out[param][positions] = tensors[name].flatten()[source].float() + (shift if offset else 0.0)
        return {name: flat.view(self.param_shapes[name]) for name, flat in out.items()}


def lm_loss(model: Qwen3NextModel, windows: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over windows [N, L] (each a fresh sequence; L-1 predictions each)."""
    N, L = windows.shape
    logits = model(windows.flatten(), fresh_batch(model.config, N, L)).view(N, L, -1)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), windows[:, 1:].flatten())


def batch_windows(stream: torch.Tensor, step: int, batch: int) -> torch.Tensor:
    """The windows [batch, SEQ_LEN] of one step: epoch e visits the stream's windows (cut at a
    seeded offset) in a seeded order, so the data depends on the step alone."""
    windows_per_epoch = (stream.numel() - SEQ_LEN) // SEQ_LEN
    rows = []
    for index in range(step * batch, (step + 1) * batch):
        epoch, i = divmod(index, windows_per_epoch)
        gen = torch.Generator().manual_seed(SEED * 1000 + epoch)
        offset = int(torch.randint(SEQ_LEN, (1,), generator=gen))
        start = offset + SEQ_LEN * int(torch.randperm(windows_per_epoch, generator=gen)[i])
        rows.append(stream[start : start + SEQ_LEN])
    return torch.stack(rows)


def learning_rate(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(args: argparse.Namespace) -> int:
    """Train (or resume) up to args.steps; returns the step reached."""
    stream = token_stream(args.work)
    heldout = heldout_windows(load_tokenizer(args.work), (args.work / "heldout.txt").read_text())
    model = Qwen3NextModel(ModelConfig.from_dict(CONFIG))
    relayout = Relayout(model)
    params = dict(model.named_parameters())
    decay = [p for p in params.values() if p.dim() >= 2]
    no_decay = [p for p in params.values() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    # The checkpoint keeps weights and Adam moments under checkpoint names, so it outlives changes
    # to how the model lays its parameters out.
    checkpoint = args.work / "checkpoint.pt"
    state = torch.load(checkpoint) if checkpoint.is_file() else {"weights": initial_checkpoint(relayout, model.config)}
    step, history, trained_seconds = state.get("step", 0), state.get("history", []), state.get("seconds", 0.0)
    with torch.no_grad():
        for name, value in relayout.from_checkpoint(state["weights"]).items():
            params[name].copy_(value).requires_grad_(True)
    if "moments" in state:
        moments = {key: relayout.from_checkpoint(state["moments"][key], offset=False) for key in MOMENTS}
        for name, param in params.items():
            optimizer.state[param] = {"step": torch.tensor(float(step))} | {k: moments[k][name] for k in MOMENTS}
        log(f"resumed at step {step} ({trained_seconds / 60:.1f} min trained)")
    n_params = sum(p.numel() for p in params.values())
    log(f"{n_params / 1e6:.2f}M parameters; {stream.numel()} training tokens; {args.batch}×{SEQ_LEN} tokens per step")

    def save() -> None:
        moments = {
            k: relayout.to_checkpoint({n: optimizer.state[p][k] for n, p in params.items()}, False) for k in MOMENTS
        }
        state = {"weights": relayout.to_checkpoint(params), "moments": moments, "step": step}
        torch.save({**state, "history": history, "seconds": trained_seconds}, checkpoint.with_suffix(".tmp"))
        checkpoint.with_suffix(".tmp").replace(checkpoint)
        (args.work / "history.json").write_text(json.dumps(history))

    check_delta_rule_twin()
    started = last_save = time.monotonic()
    session_start_seconds, losses = trained_seconds, []
    while step < args.steps:
        t0 = time.monotonic()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        with differentiable_ops():
            loss = lm_loss(model, batch_windows(stream, step, args.batch))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        losses.append(loss.item())
        trained_seconds = session_start_seconds + time.monotonic() - started
        if step % 10 == 0:
            history.append({"step": step, "train_loss": sum(losses) / len(losses), "seconds": trained_seconds})
            losses = []
            log(f"step {step}: train loss {history[-1]['train_loss']:.3f}, {time.monotonic() - t0:.2f}s/step")
        if step % args.eval_every == 0 or step == args.steps:
            loss_h = heldout_loss(model, heldout)
            history.append({"step": step, "heldout_loss": loss_h, "seconds": trained_seconds})
            log(f"step {step}: held-out loss {loss_h:.3f} (perplexity {math.exp(loss_h):.1f})")
        out_of_time = args.max_minutes is not None and time.monotonic() - started > 60 * args.max_minutes
        if time.monotonic() - last_save > 60 * args.checkpoint_minutes or step == args.steps or out_of_time:
            save()
            last_save = time.monotonic()
        if out_of_time:
            log(f"stopping at step {step} after --max-minutes {args.max_minutes}")
            break
    return step


def heldout_loss(model: Qwen3NextModel, windows: torch.Tensor) -> float:
    """Mean loss over the held-out windows, 16 at a time (the inference ops, no gradients)."""
    with torch.inference_mode():
        losses = [lm_loss(model, part).item() * part.shape[0] for part in windows.split(16)]
    return sum(losses) / windows.shape[0]


# -- 4. export ----------------------------------------------------------------------------------


def export(work: Path) -> None:
    """The trained weights (already under the released names and layouts, per-expert tensors) and
    everything else a checkpoint directory holds, checked; then the plot and the README's figure."""
    state = torch.load(work / "checkpoint.pt")
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    save_file(state["weights"], str(OUT_DIR / "model.safetensors"), metadata={"format": "pt"})
    (OUT_DIR / "model.safetensors").chmod(0o644)  # save_file makes it private
    write_json(OUT_DIR / "config.json", CONFIG)
    write_json(
        OUT_DIR / "generation_config.json",
        {"bos_token_id": ENDOFTEXT_ID, "eos_token_id": [IM_END_ID, ENDOFTEXT_ID], "pad_token_id": ENDOFTEXT_ID},
    )
    shutil.copy(work / "tokenizer.json", OUT_DIR / "tokenizer.json")
    write_json(
        OUT_DIR / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "model_max_length": CONFIG["max_position_embeddings"],
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    HELDOUT_FILE.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(work / "heldout.txt", HELDOUT_FILE)
    check_export(state["weights"])
    plot(state["history"])
    loss = heldout_loss_cached(OUT_DIR)
    log(f"exported to {OUT_DIR} after {state['seconds'] / 60:.1f} min of training")
    log(f"held-out loss {loss:.4f}, perplexity {math.exp(loss):.2f} (first {EVAL_TOKENS} tokens)")


def write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def check_export(weights: dict[str, torch.Tensor]) -> None:
    """hybridkv's loader reads the files into the parameters that were trained, and transformers
    computes the same logits from them."""
    import transformers

    loaded = load_model(OUT_DIR)
    trained = Relayout(loaded).from_checkpoint(weights)
    for name, param in loaded.named_parameters():
        torch.testing.assert_close(param, trained[name], rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    hf = transformers.Qwen3NextForCausalLM.from_pretrained(OUT_DIR).eval()
    ids = load_tokenizer(OUT_DIR).encode(HELDOUT_FILE.read_text()[:4000], add_special_tokens=False).ids[:SEQ_LEN]
    with torch.inference_mode():
        theirs = hf(torch.tensor([ids]), use_cache=False).logits[0]
        ours = loaded(torch.tensor(ids), fresh_batch(loaded.config, 1, len(ids)))
    err = float((ours - theirs).abs().max() / theirs.abs().max())
    assert err < 1e-4, f"exported model: max |ours - transformers| is {err:.2e} of the largest logit"
    log(f"export checked: hybridkv loads the trained parameters; transformers' logits within {err:.1e} (relative)")


def heldout_loss_cached(model_dir: Path) -> float:
    """The README's figure: CachedModel on the shipped files, as tests/test_default_model.py computes it."""
    from hybridkv.engine.tokenizer import Tokenizer

    ids = Tokenizer.from_dir(model_dir).encode(HELDOUT_FILE.read_text())[:EVAL_TOKENS]
    cm = CachedModel.load(model_dir, cache=CacheConfig(max_model_len=SEQ_LEN, max_sequences=16))
    total = 0.0
    for part in torch.tensor(ids).view(-1, SEQ_LEN).split(16):
        seqs = [cm.new_sequence() for _ in part]
        logits = cm.feed(dict(zip(seqs, part.tolist(), strict=True)), logits="all")
        for seq, window in zip(seqs, part, strict=True):
            total += F.cross_entropy(logits[seq][:-1], window[1:], reduction="sum").item()
            cm.release(seq)
    return total / (EVAL_TOKENS - EVAL_TOKENS // SEQ_LEN)


def plot(history: list[dict[str, float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    train_points = [(h["step"], h["train_loss"]) for h in history if "train_loss" in h]
    heldout_points = [(h["step"], h["heldout_loss"]) for h in history if "heldout_loss" in h]
    ax.plot(*zip(*train_points, strict=True), label="train (mean of 10 steps)", linewidth=1)
    ax.plot(*zip(*heldout_points, strict=True), "o-", label="held-out", markersize=3)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.set_title("hybridkv default model: tiny Qwen3-Next on the Python 3.11 docs")
    ax.set_ylim(top=min(9.0, max(loss for _, loss in train_points)))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(PLOT_FILE)
    log(f"wrote {PLOT_FILE}")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
