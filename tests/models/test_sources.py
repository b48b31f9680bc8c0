"""`--model` resolution: a path, then ollama's store, then the Hugging Face cache; offline, one error on a miss.

The ollama store and the HF cache are built here in their real on-disk layouts (ollama's
`manifests/HOST/NAMESPACE/MODEL/TAG` + `blobs/sha256-<hex>`; huggingface_hub's
`models--ORG--NAME/{blobs,refs,snapshots}`), so the stores' own readers would accept them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_reference import hf_logits, max_rel_err
from safetensors.torch import load_file

from hybridkv import CacheConfig, CachedModel, cli
from hybridkv.engine.sampling import SamplingParams
from hybridkv.errors import NotSupported
from hybridkv.models.sources import ModelNotFound, OllamaName, resolve_model

GGUF = b"GGUF\x03\x00\x00\x00" + bytes(24)  # a GGUF header's first bytes: resolution reads only the magic
MODEL = "application/vnd.ollama.image.model"
PARAMS = "application/vnd.ollama.image.params"
TEMPLATE = "application/vnd.ollama.image.template"
PROJECTOR = "application/vnd.ollama.image.projector"
ADAPTER = "application/vnd.ollama.image.adapter"

Pull = Callable[..., Path]


@pytest.fixture(autouse=True)
def empty_stores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts with empty stores of its own, and a working directory without models."""
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")


@pytest.fixture
def pull(tmp_path: Path) -> Pull:
    """pull(path under manifests/, {media type: blob bytes}) -> the manifest, laid out as `ollama pull` does."""
    store = tmp_path / "ollama"

    def write(where: str, layers: dict[str, bytes]) -> Path:
        (store / "blobs").mkdir(parents=True, exist_ok=True)
        entries = []
        for media_type, content in layers.items():
            digest = hashlib.sha256(content).hexdigest()
            (store / "blobs" / f"sha256-{digest}").write_bytes(content)
            entries.append({"mediaType": media_type, "digest": f"sha256:{digest}", "size": len(content)})
        manifest = store / "manifests" / where
        manifest.parent.mkdir(parents=True, exist_ok=True)
        config = {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": "sha256:" + "0" * 64}
        manifest.write_text(json.dumps({"schemaVersion": 2, "config": config, "layers": entries}))
        return manifest

    return write


def blob_of(store: Path, content: bytes) -> Path:
    return store / "blobs" / f"sha256-{hashlib.sha256(content).hexdigest()}"


def hf_cache(root: Path, repo_id: str, files: dict[str, Path | bytes], revision: str = "main") -> Path:
    """Add a snapshot of `repo_id` to a Hugging Face cache as huggingface_hub lays it out: files in
    blobs/, linked from snapshots/<commit>/, and refs/<revision> naming the commit. Returns the snapshot."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for name, content in files.items():
        data = content.read_bytes() if isinstance(content, Path) else content
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(Path("../../blobs") / blob.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return snapshot


# -- paths ------------------------------------------------------------------------------------------


def test_a_checkpoint_directory_resolves_to_itself_and_is_served_under_its_name(tmp_path: Path) -> None:
    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    source = resolve_model(str(model))
    assert (source.kind, source.path, source.served_name, source.gguf_parts) == ("dir", model, "my-model", ())
    assert not source.is_gguf


def test_a_split_gguf_set_is_named_by_its_first_part(tmp_path: Path) -> None:
    parts = [tmp_path / f"Qwen3-Next-Q4_K_M-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    for part in parts:
        part.write_bytes(GGUF)
    source = resolve_model(parts[0])
    assert (source.kind, source.path, source.gguf_parts) == ("gguf", parts[0], tuple(parts))
    assert source.served_name == "Qwen3-Next-Q4_K_M"
    with pytest.raises(ModelNotFound, match="name the first part"):
        resolve_model(parts[1])
    parts[2].unlink()
    with pytest.raises(ModelNotFound, match="missing: Qwen3-Next-Q4_K_M-00003-of-00003.gguf"):
        resolve_model(parts[0])


def test_a_single_gguf_file_and_a_file_that_is_not_one(tmp_path: Path) -> None:
    (tmp_path / "tiny.gguf").write_bytes(GGUF)
    source = resolve_model(str(tmp_path / "tiny.gguf"))
    assert (source.kind, source.gguf_parts, source.served_name) == ("gguf", (tmp_path / "tiny.gguf",), "tiny")
    (tmp_path / "fake.gguf").write_bytes(b"PK\x03\x04 a zip")
    with pytest.raises(ModelNotFound, match="not a GGUF file"):
        resolve_model(str(tmp_path / "fake.gguf"))


def test_an_existing_path_wins_over_an_ollama_name(pull: Pull) -> None:
    pull("registry.ollama.ai/library/qwen3/latest", {MODEL: GGUF})
    Path("qwen3").mkdir()  # in the working directory
    with pytest.raises(ModelNotFound, match="qwen3 is not a model: it has no config.json"):
        resolve_model("qwen3")  # the path is taken, and said not to be a model
    (Path("qwen3") / "config.json").write_text("{}")
    assert resolve_model("qwen3").kind == "dir"


# -- ollama names -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "manifest", "served"),
    [
        ("qwen3.5:4b", "registry.ollama.ai/library/qwen3.5/4b", "qwen3.5:4b"),
        ("qwen3-next:80b", "registry.ollama.ai/library/qwen3-next/80b", "qwen3-next:80b"),
        ("qwen3.5", "registry.ollama.ai/library/qwen3.5/latest", "qwen3.5:latest"),
        ("library/qwen3.5:4b", "registry.ollama.ai/library/qwen3.5/4b", "qwen3.5:4b"),
        ("registry.ollama.ai/library/qwen3.5:4b", "registry.ollama.ai/library/qwen3.5/4b", "qwen3.5:4b"),
        ("https://registry.ollama.ai/library/qwen3.5:4b", "registry.ollama.ai/library/qwen3.5/4b", "qwen3.5:4b"),
        ("someone/tuned:q4", "registry.ollama.ai/someone/tuned/q4", "someone/tuned:q4"),
        ("hf.co/unsloth/Qwen3.5-4B-GGUF:Q4_K_M", "hf.co/unsloth/Qwen3.5-4B-GGUF/Q4_K_M", None),
        ("localhost:5000/team/model:v1", "localhost:5000/team/model/v1", None),
        ("QWEN3.5:4B", "registry.ollama.ai/library/qwen3.5/4b", "QWEN3.5:4B"),  # names ignore case
    ],
)
def test_ollama_name_forms_find_their_manifest(
    tmp_path: Path, pull: Pull, spec: str, manifest: str, served: str | None
) -> None:
    weights = GGUF + manifest.encode()
    pull(manifest, {MODEL: weights, TEMPLATE: b"{{ .Prompt }}"})
    source = resolve_model(spec)
    assert source.kind == "ollama" and source.is_gguf
    assert source.path == source.gguf_parts[0] == blob_of(tmp_path / "ollama", weights)
    assert source.served_name == (served or spec)
    assert source.notes == ()  # the template layer is not used, and that is no news


def test_a_bare_name_is_its_latest_tag_not_another(pull: Pull) -> None:
    pull("registry.ollama.ai/library/qwen3.5/4b", {MODEL: GGUF + b"4b"})
    with pytest.raises(ModelNotFound, match="registry.ollama.ai/library/qwen3.5/latest"):
        resolve_model("qwen3.5")
    pull("registry.ollama.ai/library/qwen3.5/latest", {MODEL: GGUF + b"latest"})
    assert resolve_model("qwen3.5").path.read_bytes().endswith(b"latest")


@pytest.mark.parametrize(
    "text", ["a/b/c/d", "name:", ":tag", "na me", ".hidden", "ns.x/model", "-dash", "Qwen/Qwen3.5-0.8B@main", ""]
)
def test_what_ollama_does_not_parse_as_a_name(text: str) -> None:
    assert OllamaName.parse(text) is None


def test_a_missing_blob_is_named_with_the_pull_that_fixes_it(tmp_path: Path, pull: Pull) -> None:
    pull("registry.ollama.ai/library/qwen3.5/4b", {MODEL: GGUF})
    blob = blob_of(tmp_path / "ollama", GGUF)
    blob.unlink()
    with pytest.raises(ModelNotFound, match="missing; `ollama pull qwen3.5:4b`") as error:
        resolve_model("qwen3.5:4b")
    assert str(blob) in str(error.value)


def test_a_manifest_without_a_model_layer_or_with_a_truncated_blob_is_an_error(tmp_path: Path, pull: Pull) -> None:
    pull("registry.ollama.ai/library/notes/latest", {TEMPLATE: b"{{ .Prompt }}"})
    with pytest.raises(ModelNotFound, match=f"has no {MODEL} layer"):
        resolve_model("notes")
    pull("registry.ollama.ai/library/cut/latest", {MODEL: GGUF})
    blob_of(tmp_path / "ollama", GGUF).write_bytes(GGUF[:10])  # an interrupted download
    with pytest.raises(ModelNotFound, match="has 10 bytes, its manifest says 32"):
        resolve_model("cut")


def test_the_params_layer_becomes_sampling_defaults(pull: Pull) -> None:
    params = {
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
        "min_p": 0,
        "repeat_penalty": 1.1,
        "stop": ["<|im_start|>", "<|im_end|>"],
        "num_ctx": 8192,
        "num_predict": -1,
        "mirostat": 2,
    }
    pull("registry.ollama.ai/library/qwen3.5/4b", {MODEL: GGUF, PARAMS: json.dumps(params).encode()})
    source = resolve_model("qwen3.5:4b")
    assert dict(source.sampling_defaults) == {
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
        "min_p": 0,
        "repetition_penalty": 1.1,
        "stop": ("<|im_start|>", "<|im_end|>"),
    }
    assert source.notes == ("ollama params not applied: num_ctx=8192, mirostat=2",)
    # the keys are SamplingParams fields, and the engine's defaulting reads them
    assert SamplingParams(**source.sampling_defaults).stop == ("<|im_start|>", "<|im_end|>")
    filled = SamplingParams().with_defaults(source.sampling_defaults)
    assert (filled.temperature, filled.top_k, filled.top_p, filled.repetition_penalty) == (0.6, 20, 0.95, 1.1)


def test_a_vision_projector_is_ignored_with_a_note_and_an_adapter_is_refused(pull: Pull) -> None:
    pull("registry.ollama.ai/library/qwen3.5/4b", {MODEL: GGUF, PROJECTOR: GGUF + b"vision"})
    assert resolve_model("qwen3.5:4b").notes == ("the vision projector layer is ignored: hybridkv runs text only",)
    pull("registry.ollama.ai/library/tuned/latest", {MODEL: GGUF, ADAPTER: GGUF + b"lora"})
    with pytest.raises(NotSupported, match="LoRA adapter"):
        resolve_model("tuned")


def test_an_ollama_model_loads_from_its_blob(pull: Pull) -> None:
    """The blob is a GGUF file (here one written by llama.cpp's converter): it loads as such."""
    fixture = Path(__file__).parent.parent / "data" / "gguf"
    pull("registry.ollama.ai/library/qwen3.5/4b", {MODEL: (fixture / "qwen35-tiny-f32.gguf").read_bytes()})
    golden = load_file(fixture / "qwen35-tiny.logits.safetensors")
    cm = CachedModel.load("qwen3.5:4b", cache=CacheConfig(max_sequences=1, max_model_len=32))
    seq = cm.new_sequence()
    logits = cm.feed({seq: golden["tokens"].tolist()})[seq]
    assert max_rel_err(logits, golden["logits"]) <= 1e-4


# -- the Hugging Face cache -------------------------------------------------------------------------


def test_a_repo_id_resolves_to_its_cached_snapshot_at_main_or_a_revision(tmp_path: Path) -> None:
    main = hf_cache(tmp_path / "hf", "Qwen/Qwen3.5-0.8B", {"config.json": b'{"v": "main"}'})
    v1 = hf_cache(tmp_path / "hf", "Qwen/Qwen3.5-0.8B", {"config.json": b'{"v": "v1"}'}, revision="v1")
    source = resolve_model("Qwen/Qwen3.5-0.8B")
    assert (source.kind, source.path, source.served_name) == ("hf", main, "Qwen/Qwen3.5-0.8B")
    assert resolve_model("Qwen/Qwen3.5-0.8B@v1").path == v1
    assert resolve_model(f"Qwen/Qwen3.5-0.8B@{v1.name}").path == v1  # a commit hash
    with pytest.raises(ModelNotFound, match="no snapshot of Qwen/Qwen3.5-0.8B at revision v2"):
        resolve_model("Qwen/Qwen3.5-0.8B@v2")


def test_the_hf_cache_follows_hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    snapshot = hf_cache(tmp_path / "home" / "hub", "org/model", {"config.json": b"{}"})
    assert resolve_model("org/model").path == snapshot


def test_a_gguf_only_repo_resolves_to_its_gguf_file(tmp_path: Path) -> None:
    snapshot = hf_cache(tmp_path / "hf", "unsloth/Qwen3.5-4B-GGUF", {"Qwen3.5-4B-Q4_K_M.gguf": GGUF})
    source = resolve_model("unsloth/Qwen3.5-4B-GGUF")
    assert (source.kind, source.gguf_parts) == ("hf", (snapshot / "Qwen3.5-4B-Q4_K_M.gguf",))
    assert source.served_name == "unsloth/Qwen3.5-4B-GGUF"


def test_a_miss_is_one_line_naming_every_place_looked_in(tmp_path: Path, capsys: Any) -> None:
    with pytest.raises(ModelNotFound) as error:
        resolve_model("nobody/nothing")
    message = str(error.value)
    assert "\n" not in message
    assert f"no such directory or .gguf file {tmp_path / 'cwd' / 'nobody' / 'nothing'}" in message
    assert f"no ollama manifest {tmp_path / 'ollama/manifests/registry.ollama.ai/nobody/nothing/latest'}" in message
    assert f"no snapshot of nobody/nothing in the Hugging Face cache {tmp_path / 'hf'}" in message
    assert "never downloads" in message
    with pytest.raises(ModelNotFound, match="not an ollama model name; not a Hugging Face repo id"):
        resolve_model("/no/such:x/y")
    assert cli.main(["run", "hello", "--model", "nobody/nothing"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridkv: error: model 'nobody/nothing' not found") and err.count("\n") == 1


def test_a_cached_repo_id_loads_end_to_end(tmp_path: Path, tiny_checkpoint: tuple[Any, Path]) -> None:
    hf_model, checkpoint = tiny_checkpoint
    files: dict[str, Path | bytes] = {p.name: p for p in checkpoint.iterdir() if p.is_file()}
    snapshot = hf_cache(tmp_path / "hf", "tiny-org/tiny-qwen3-next", files)
    cm = CachedModel.load("tiny-org/tiny-qwen3-next", cache=CacheConfig(max_model_len=32, max_sequences=2))
    ids = torch.randint(0, cm.vocab_size, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    seq = cm.new_sequence()
    logits = cm.feed({seq: ids})[seq]
    assert max_rel_err(logits, hf_logits(hf_model, ids)) <= 1e-4
    assert resolve_model("tiny-org/tiny-qwen3-next").path == snapshot
