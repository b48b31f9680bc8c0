"""Regenerate tests/data/gguf/: small GGUF files written by llama.cpp's own converter, with the
logits transformers gives on the checkpoints they came from, so the GGUF loader is checked
against a third party without building anything at test time.

    .venv/bin/python scripts/make_gguf_fixtures.py                    # pip-downloads the sdist
    .venv/bin/python scripts/make_gguf_fixtures.py --sdist PATH       # a downloaded .tar.gz or its extracted folder

1. Converter: `convert_hf_to_gguf.py` of the llama.cpp that the llama-cpp-python 0.3.36 source
   distribution vendors (PyPI has no wheel of it, so `pip download --no-deps --no-binary :all:`
   fetches the sdist and nothing is built). It runs in a child process with the vendored gguf-py
   first on sys.path, not the PyPI gguf. The llama.cpp commit comes from the sdist's CHANGELOG.md
   and goes into MANIFEST.txt.
2. Checkpoints, random and seeded, saved in float32:
   - `qwen3next-tiny`: tests/hf_reference.py's TINY Qwen3-Next with vocabulary 4096 and the
     default model's tokenizer (hybridkv/assets/default_model; the default model itself is 18 MB).
   - `qwen35-tiny`: a dense Qwen3.5 vision-language checkpoint (tests/qwen35_reference.py) with
     tied embeddings, as Qwen3.5-0.8B has them, so its file has no `output.weight`.
   - `qwen35moe-tiny`: a Qwen3.5 MoE vision-language checkpoint, untied, as Qwen3.5-35B-A3B.
   Both Qwen3.5 ones have the compact test tokenizer (tests/qwen35_tokenizer.py) and a whole MTP
   block as released checkpoints do: `mtp.fc`, the three `mtp.*norm*`, and `mtp.layers.0.*` (a copy
   of the last full-attention layer), with `mtp_num_hidden_layers: 1` in text_config.
   The seeds (8 for Qwen3-Next, 0 for Qwen3.5) were picked so that rounding the weights to Q8_0
   and BF16 as the converter does (tried with gguf-py on the transformers weights) leaves every
   router choosing the same experts for PROMPT; most seeds flip one or more choices.
3. Two accommodations, both made in the child process (no file of the sdist is edited):
   - Tokenizer: the converter names the pre-tokenizer by hashing the tokens of a fixed text and
     refuses a hash it does not know, which the fixture tokenizers are. `get_vocab_base_pre` is
     replaced by one returning `qwen2` for Qwen3-Next (the default model's tokenizer splits with
     Qwen2's regex) and `qwen35` for Qwen3.5 (the test tokenizer is transformers' Qwen3_5Tokenizer).
   - MTP: the converter asserts on a Qwen3-Next checkpoint without `mtp.*` tensors, so that one is
     converted with its `--no-mtp` option. The Qwen3.5 ones keep their MTP block, written past the
     decoder as `blk.{num_hidden_layers}` (`nextn_predict_layers` = 1): a loader must skip it.
4. Outputs, in --out: `<model>-f32.gguf` and `<model>-q8_0.gguf` for each, `qwen3next-tiny-bf16.gguf`;
   `<model>.logits.safetensors` with `tokens` [T] (int64) and `logits` [T, V] (float32: transformers,
   no cache, on the original float32 weights); MANIFEST.txt: the prompt, versions and, for MoE
   models, `min_topk_margin` (the smallest gap between the last chosen and the first unchosen
   router probability over all layers and tokens), then each file's metadata and tensors (name,
   type, ggml shape), read back with the PyPI gguf-py.

5. K-quants, with `--quantizer` (an installed llama-cpp-python, built from the same sdist):
   `qwen35moe-k-q4_k_m.gguf` and `qwen35moe-k-q2_k.gguf`, llama.cpp's own Q4_K_M and Q2_K mixtures
   (`llama_model_quantize`, ftypes 15 and 10, no importance matrix) of a Qwen3.5 MoE whose every
   projection has rows of 256 (hidden 256, 64-wide heads, expert width 256), so its projections
   are K-quant blocks (Q4_K and Q6_K; Q2_K, Q3_K, Q4_K and Q6_K) rather than the fallback types a
   narrower model gets; its F32 conversion is not kept. gguf-py cannot write K-quants. With each,
   `<file>.llama_cpp_logits.safetensors`: llama.cpp's own logits on that file and PROMPT
   (`Llama.eval`, logits for every token), the engine-to-engine check.
   `--quantizer --only q2_k` writes that one file and its logits and replaces its MANIFEST.txt
   section, leaving every other fixture as it is (how the Q2_K file was added).
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import torch
import transformers
from gguf import GGUFReader, GGUFValueType
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from hf_reference import make_hf_model, save_checkpoint  # noqa: E402
from qwen35_reference import TINY_MOE, TINY_TEXT, TINY_VISION, make_qwen35, save_qwen35  # noqa: E402
from qwen35_tokenizer import COMPACT_VOCAB, write_qwen35_tokenizer  # noqa: E402

SDIST = "llama-cpp-python==0.3.36"
DEFAULT_MODEL = REPO / "hybridkv" / "assets" / "default_model"
OUT = REPO / "tests" / "data" / "gguf"
PROMPT = "<|im_start|>user\nHello there, the weather<|im_end|>"  # 10 tokens (Qwen3-Next), 13 (Qwen3.5)

# Runs in the child: the vendored llama.cpp and gguf-py first on sys.path, the pre-tokenizer name
# forced, then the converter as a script. argv: llama.cpp dir, pre-tokenizer, converter arguments.
CONVERT = """
import runpy, sys
llama, pre = sys.argv[1], sys.argv[2]
sys.path[:0] = [llama + "/gguf-py", llama]
import gguf
assert gguf.__file__.startswith(llama), gguf.__file__
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
sys.argv = [llama + "/convert_hf_to_gguf.py", *sys.argv[3:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def llama_cpp_dir(sdist: Path | None, work: Path) -> Path:
    """The vendored llama.cpp of the sdist at `sdist` (a .tar.gz or the folder it extracts to),
    pip-downloaded when None."""
    if sdist is None:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SDIST, "-d", str(work)],
            check=True,
        )
        sdist = next(work.glob("llama_cpp_python-*.tar.gz"))
    if sdist.is_file():
        with tarfile.open(sdist) as tar:
            tar.extractall(work / "sdist", filter="data")
        sdist = next((work / "sdist").iterdir())
    llama = sdist / "vendor" / "llama.cpp"
    if not (llama / "convert_hf_to_gguf.py").is_file():
        raise SystemExit(f"{sdist} is not a llama-cpp-python sdist: no vendor/llama.cpp/convert_hf_to_gguf.py")
    return llama


def converter_version(llama: Path) -> str:
    """'llama-cpp-python 0.3.36, llama.cpp <commit>': the sdist's PKG-INFO, and its CHANGELOG.md
    entry for that version ("update llama.cpp to ggml-org/llama.cpp@<commit>")."""
    sdist = llama.parents[1]
    version = re.search(r"^Version: (\S+)$", (sdist / "PKG-INFO").read_text(), re.M)
    changes = (sdist / "CHANGELOG.md").read_text()
    commit = version and re.search(rf"## \[{re.escape(version[1])}\].*?ggml-org/llama\.cpp@([0-9a-f]+)", changes, re.S)
    if not version or not commit:
        raise SystemExit(f"no version, or no llama.cpp commit for it, in {sdist}/PKG-INFO and CHANGELOG.md")
    return f"llama-cpp-python {version[1]}, llama.cpp {commit[1]}"


def qwen3next_checkpoint(path: Path) -> tuple[Any, list[int]]:
    """The tiny Qwen3-Next with the default model's tokenizer files; the model and PROMPT's ids."""
    ids = dict(bos_token_id=4093, eos_token_id=4095, pad_token_id=4093)  # the default model's
    model = make_hf_model(seed=8, vocab_size=4096, **ids)
    save_checkpoint(model, path)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(DEFAULT_MODEL / name, path / name)
    return model, _encode(path)


def qwen35_checkpoint(path: Path, moe: bool) -> tuple[Any, list[int]]:
    """A tiny Qwen3.5 (dense and tied, or MoE) vision-language checkpoint with an MTP block."""
    model = make_qwen35(moe=moe, seed=0, tie=not moe, vocab_size=COMPACT_VOCAB, mtp_num_hidden_layers=1)
    save_qwen35(model, path, mtp=True)  # mtp.fc and mtp.norm
    tensors = load_file(path / "model.safetensors")
    text = model.config.get_text_config()
    last_full = max(i for i, kind in enumerate(text.layer_types) if kind == "full_attention")
    prefix = f"model.language_model.layers.{last_full}."
    for name, t in list(tensors.items()):
        if name.startswith(prefix):
            tensors["mtp.layers.0." + name[len(prefix) :]] = t.clone()
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden"):
        tensors[f"mtp.{norm}.weight"] = torch.randn(text.hidden_size)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    write_qwen35_tokenizer(path, compact=True)
    return model, _encode(path)


def qwen35_k_checkpoint(path: Path) -> tuple[Any, list[int]]:
    """A Qwen3.5 MoE vision-language checkpoint whose projections all have rows of 256 weights."""
    text = {**TINY_TEXT, **TINY_MOE}
    text.update(
        hidden_size=256,
        head_dim=64,
        linear_key_head_dim=64,  # = the value head width: llama.cpp's qwen35 loader assumes it
        linear_value_head_dim=64,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
        vocab_size=COMPACT_VOCAB,
        tie_word_embeddings=False,
    )
    text["rope_parameters"] = dict(text["rope_parameters"], mrope_section=[8, 4, 4])  # 64-wide heads
    config = transformers.Qwen3_5MoeConfig(
        text_config=text, vision_config=dict(TINY_VISION, out_hidden_size=256), tie_word_embeddings=False
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Qwen3_5MoeForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "visual" not in name and name.endswith(("norm.weight", "layernorm.weight", "A_log", "dt_bias")):
                param.add_(torch.empty_like(param).uniform_(-0.5, 0.5))
    save_qwen35(model, path)
    write_qwen35_tokenizer(path, compact=True)
    return model, _encode(path)


def qwen3next_wide_checkpoint(path: Path) -> Any:
    """A 2-layer Qwen3-Next whose every row is 256 wide (so Q4_K_M keeps K-quants, no fallbacks),
    with the compact test tokenizer: the model of `qwen3next-wide-q4_k_m.gguf`, which hybridkv's
    own writer makes (scripts/gguf_vs_llama_cpp.py --fixture)."""
    wide = dict(
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_experts=2,
        num_experts_per_tok=1,
        hidden_size=256,
        head_dim=64,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
    )
    model = make_hf_model(seed=3, vocab_size=COMPACT_VOCAB, **wide)
    save_checkpoint(model, path)
    write_qwen35_tokenizer(path, compact=True)
    return model


def llama_quantize(src: Path, dst: Path, ftype: int) -> None:
    """llama.cpp's own quantizer on a GGUF file (`llama_model_quantize` of llama-cpp-python)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params) != 0:
        raise SystemExit(f"llama_model_quantize failed on {src}")


def llama_cpp_logits(path: Path, tokens: list[int]) -> torch.Tensor:
    """llama.cpp's own logits [T, V] on a GGUF file (llama-cpp-python, default context: F16 KV)."""
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(str(path), n_ctx=256, logits_all=True, verbose=False)
    llm.eval(tokens)
    return torch.from_numpy(np.array(llm.scores[: len(tokens)], dtype=np.float32))


def _encode(path: Path) -> list[int]:
    return list(transformers.AutoTokenizer.from_pretrained(path).encode(PROMPT, add_special_tokens=False))


def golden_logits(model: Any, tokens: list[int]) -> tuple[torch.Tensor, float | None]:
    """transformers' no-cache logits [T, V] and, for a MoE model, the smallest top-k router margin."""
    text = model.config.get_text_config()
    moe = getattr(text, "num_experts", None) is not None
    with torch.no_grad():
        out = model(input_ids=torch.tensor([tokens]), use_cache=False, output_router_logits=moe)
    if not moe:
        return out.logits[0].float(), None
    k = text.num_experts_per_tok
    probs = torch.cat(out.router_logits).softmax(-1).topk(k + 1, dim=-1).values  # [layers * T, k + 1]
    return out.logits[0].float(), float((probs[:, k - 1] - probs[:, k]).min())


def convert(llama: Path, checkpoint: Path, out: Path, outtype: str, pre: str, extra: list[str]) -> None:
    args = [str(checkpoint), "--outtype", outtype, "--outfile", str(out), *extra]
    subprocess.run([sys.executable, "-c", CONVERT, str(llama), pre, *args], check=True)


# The K-quant fixtures: file type → llama.cpp's ftype (LLAMA_FTYPE_MOSTLY_*).
K_FTYPES = {"q4_k_m": 15, "q2_k": 10}


def k_fixture(llama: Path, work: Path, out: Path, file_type: str) -> Path:
    """`qwen35moe-k-<file_type>.gguf` by llama.cpp's quantizer from the converter's F32 file of the
    K checkpoint (built in `work` once), and llama.cpp's own logits on it beside it."""
    name = "qwen35moe-k"
    if not (work / f"{name}-f32.gguf").is_file():
        qwen35_k_checkpoint(work / name)
        convert(llama, work / name, work / f"{name}-f32.gguf", "f32", "qwen35", ["--no-mtp"])
    path = out / f"{name}-{file_type}.gguf"
    llama_quantize(work / f"{name}-f32.gguf", path, K_FTYPES[file_type])
    tokens = _encode(work / name)
    theirs = {"tokens": torch.tensor(tokens), "logits": llama_cpp_logits(path, tokens)}
    save_file(theirs, str(out / f"{name}-{file_type}.llama_cpp_logits.safetensors"))
    return path


def replace_manifest_entry(manifest: Path, path: Path) -> None:
    """MANIFEST.txt with `path`'s section (from its "## name" line to the next) replaced, or added last."""
    text = manifest.read_text()
    head, *sections = re.split(r"(?m)^(?=## )", text)
    sections = [s for s in sections if not s.startswith(f"## {path.name} ")] + [manifest_entry(path)]
    manifest.write_text(head + "\n".join(s.rstrip("\n") + "\n" for s in sections))


def manifest_entry(path: Path) -> str:
    """The file's metadata (long arrays and strings summarised) and tensors, as gguf-py reads them."""
    reader = GGUFReader(path)
    data = path.read_bytes()
    lines = [f"## {path.name}  ({len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()})", ""]
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        value = field.contents()
        if field.types[0] == GGUFValueType.ARRAY and len(value) > 16:
            value = f"[{len(value)} x {field.types[-1].name}]"
        elif isinstance(value, str) and len(value) > 60:
            value = f"<string, {len(value)} chars>"
        lines.append(f"{name} = {value}")
    lines += ["", f"{len(reader.tensors)} tensors (name, type, ne: fastest dimension first):"]
    for t in reader.tensors:
        lines.append(f"  {t.name:40s} {t.tensor_type.name:5s} {[int(n) for n in t.shape]}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sdist", type=Path, help=f"{SDIST} as .tar.gz or extracted (default: pip download it)")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument(
        "--quantizer", action="store_true", help="also write the K-quant fixtures (needs llama-cpp-python installed)"
    )
    parser.add_argument(
        "--only", choices=sorted(K_FTYPES), help="with --quantizer: write only this K-quant fixture, keep the rest"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        llama = llama_cpp_dir(args.sdist, work)
        version = converter_version(llama)
        if args.only:
            if not args.quantizer:
                parser.error("--only needs --quantizer")
            replace_manifest_entry(args.out / "MANIFEST.txt", k_fixture(llama, work, args.out, args.only))
            return
        # name: (build, pre-tokenizer, converter options, output types)
        models = {
            "qwen3next-tiny": (qwen3next_checkpoint, "qwen2", ["--no-mtp"], ["f32", "q8_0", "bf16"]),
            "qwen35-tiny": (lambda p: qwen35_checkpoint(p, moe=False), "qwen35", [], ["f32", "q8_0"]),
            "qwen35moe-tiny": (lambda p: qwen35_checkpoint(p, moe=True), "qwen35", [], ["f32", "q8_0"]),
        }
        files, goldens = [], []
        for name, (build, pre, extra, outtypes) in models.items():
            checkpoint = work / name
            model, tokens = build(checkpoint)
            logits, margin = golden_logits(model, tokens)
            golden = {"tokens": torch.tensor(tokens), "logits": logits.contiguous()}
            save_file(golden, str(args.out / f"{name}.logits.safetensors"))  # no metadata: its order varies
            goldens.append(f"{name}.logits.safetensors: tokens {tokens}, logits {list(logits.shape)}")
            if margin is not None:
                goldens[-1] += f", min_topk_margin {margin:.6f}"
            for outtype in outtypes:
                files.append(args.out / f"{name}-{outtype}.gguf")
                convert(llama, checkpoint, files[-1], outtype, pre, extra)
        if args.quantizer:
            name = "qwen35moe-k"
            model, tokens = qwen35_k_checkpoint(work / name)
            logits, margin = golden_logits(model, tokens)
            save_file(
                {"tokens": torch.tensor(tokens), "logits": logits.contiguous()},
                str(args.out / f"{name}.logits.safetensors"),
            )
            goldens.append(
                f"{name}.logits.safetensors: tokens {tokens}, logits {list(logits.shape)}, min_topk_margin {margin:.6f}"
            )
            convert(llama, work / name, work / f"{name}-f32.gguf", "f32", "qwen35", ["--no-mtp"])
            files += [k_fixture(llama, work, args.out, file_type) for file_type in K_FTYPES]
    header = [
        f"# GGUF fixtures written by {version}'s convert_hf_to_gguf.py (scripts/make_gguf_fixtures.py)",
        "",
        f"Golden logits: transformers {transformers.__version__}, torch {torch.__version__}, float32, no cache,",
        f"prompt {PROMPT!r}",
        *goldens,
        "",
        "",
    ]
    (args.out / "MANIFEST.txt").write_text("\n".join(header) + "\n".join(manifest_entry(f) for f in files))
    for f in sorted(args.out.iterdir()):
        print(f"{f.stat().st_size:>10}  {f.name}")


if __name__ == "__main__":
    main()
