"""What `--model` names, found on this machine: a path, an ollama model, or a Hugging Face repo id.

`resolve_model(spec)` tries, in this order, and never downloads anything:

1. an existing path: a Hugging Face checkpoint directory, or a `.gguf` file (of a split set
   `NAME-00001-of-0000N.gguf`, the first part names the set);
2. an ollama model name (`qwen3.5:4b`; `NAME` is `NAME:latest`; also `namespace/NAME:TAG` and
   `host/namespace/NAME:TAG`), from ollama's store (`$OLLAMA_MODELS`, else `~/.ollama/models`):
   `manifests/HOST/NAMESPACE/NAME/TAG` -> its `application/vnd.ollama.image.model` layer ->
   `blobs/sha256-<hex>`, a GGUF file. The params layer gives sampling defaults; the template layer
   (a Go template) is not used: the chat template comes from the GGUF's `tokenizer.chat_template`;
3. a Hugging Face repo id (`Qwen/Qwen3.5-0.8B`, optionally `@revision`), from the local HF cache
   (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`).

A miss is one `ModelNotFound` (one line) saying what each step looked for.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from hybridkv.errors import NotSupported

Kind = Literal["dir", "gguf", "ollama", "hf"]
GGUF_MAGIC = b"GGUF"
_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$")  # llama.cpp's gguf-split names

OLLAMA_HOST, OLLAMA_NAMESPACE, OLLAMA_TAG = "registry.ollama.ai", "library", "latest"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
_OLLAMA_LAYER = "application/vnd.ollama.image."
_DIGEST = re.compile(r"^sha256:(?P<hex>[0-9a-f]{64})$")

# ollama's params (api.Options) -> SamplingParams fields
_OLLAMA_SAMPLING = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "seed": "seed",
    "num_predict": "max_tokens",
}
_INTEGERS = {"top_k", "seed", "num_predict"}


class ModelNotFound(FileNotFoundError):
    """`--model` names nothing on this machine, or an ollama store entry is broken; one line."""


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """A model found on this machine.

    `path` is the checkpoint directory, or the first file of a GGUF model; `gguf_parts` all its
    files in order (`()` for a directory; ollama blobs and GGUF-only HF snapshots are GGUF too).
    `served_name` is the id the server answers to. `sampling_defaults` are keyed by `SamplingParams`
    field names (the engine fills temperature, top_k, top_p, min_p and repetition_penalty from
    them). `notes` say what of the source is not used; `description` is one line for logs.
    """

    kind: Kind
    path: Path
    served_name: str
    description: str
    gguf_parts: tuple[Path, ...] = ()
    sampling_defaults: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}), hash=False)
    notes: tuple[str, ...] = ()

    @property
    def is_gguf(self) -> bool:
        return bool(self.gguf_parts)


def resolve_model(spec: str | Path) -> ResolvedModel:
    """The model `spec` names: a path, then an ollama name, then a Hugging Face repo id; offline."""
    text = str(spec).strip()
    if not text:
        raise ModelNotFound("the model name is empty")
    path = Path(text).expanduser()
    if path.exists():
        return _from_path(path)
    tried = [f"no such directory or .gguf file {os.path.abspath(path)}"]

    name = OllamaName.parse(text)
    if name is None:
        tried.append("not an ollama model name")
    else:
        store = ollama_models_dir()
        manifest = _find_manifest(store / "manifests", name)
        if manifest is not None:
            return _from_ollama(name, manifest, store)
        tried.append(f"no ollama manifest {store / 'manifests' / name.filepath}")

    found = _from_hf_cache(text, tried)
    if found is not None:
        return found
    raise ModelNotFound(
        f"model {text!r} not found on this machine: {'; '.join(tried)} "
        "(hybridkv never downloads: `ollama pull` or `hf download` it first)"
    )


# -- paths --------------------------------------------------------------------------------------


def _from_path(path: Path, kind: Kind = "dir", served_name: str | None = None) -> ResolvedModel:
    # a file keeps its own name: in an HF snapshot it is a link to blobs/<hash>
    path = path.resolve() if path.is_dir() else Path(os.path.abspath(path))
    if path.is_dir():
        # a folder without config.json may hold one GGUF model (a GGUF-only HF repo does)
        sets = [] if (path / "config.json").is_file() else sorted(p for p in path.glob("*.gguf") if _names_a_set(p))
        if len(sets) > 1:
            names = ", ".join(p.name for p in sets)
            raise ModelNotFound(f"{path} has no config.json but several GGUF models ({names}): name one of the files")
        if not sets and (path / "config.json").is_file():  # a checkpoint directory: the loader checks its files
            return ResolvedModel(kind, path, served_name or path.name, f"{_KIND_WORDS[kind]} {path}")
        if not sets:
            raise ModelNotFound(f"{path} is not a model: it has no config.json and no .gguf file; {EXPECTED}")
        path = sets[0]
    if path.suffix != ".gguf":
        raise ModelNotFound(f"{path} is not a model: {EXPECTED}")
    parts = gguf_parts(path)
    kind = "hf" if kind == "hf" else "gguf"
    set_name = _SPLIT.sub(r"\g<stem>", path.name).removesuffix(".gguf")
    described = f"{_KIND_WORDS[kind]} {path}" + (f" (+{len(parts) - 1} split parts)" if len(parts) > 1 else "")
    return ResolvedModel(kind, path, served_name or set_name, described, parts)


_KIND_WORDS = {"dir": "directory", "gguf": "GGUF", "ollama": "ollama", "hf": "Hugging Face cache"}
EXPECTED = (
    "a model is a directory with config.json, tokenizer.json and model.safetensors (or "
    "model.safetensors.index.json and its shards), or a .gguf file"
)


def _names_a_set(path: Path) -> bool:
    """A whole GGUF file, or the first part of a split set."""
    match = _SPLIT.match(path.name)
    return match is None or int(match["part"]) == 1


def gguf_parts(path: Path) -> tuple[Path, ...]:
    """Every file of the GGUF model `path` names, in order; each checked to be present and a GGUF."""
    match = _SPLIT.match(path.name)
    if match is None:
        parts: tuple[Path, ...] = (path,)
    else:
        count = int(match["count"])
        first = path.with_name(f"{match['stem']}-00001-of-{count:05d}.gguf")
        if int(match["part"]) != 1:
            raise ModelNotFound(f"{path} is part {int(match['part'])} of a split GGUF: name the first part, {first}")
        parts = tuple(path.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1))
        if missing := [p.name for p in parts if not p.is_file()]:
            raise ModelNotFound(f"{path}: split GGUF parts missing: {', '.join(missing)}")
    for part in parts:
        _check_gguf(part)
    return parts


def _check_gguf(path: Path, what: str = "") -> None:
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelNotFound(f"{what or path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")


# -- ollama -------------------------------------------------------------------------------------


def ollama_models_dir() -> Path:
    """ollama's store: `$OLLAMA_MODELS`, else `~/.ollama/models` (as ollama's envconfig.Models)."""
    return Path(os.environ.get("OLLAMA_MODELS") or "~/.ollama/models").expanduser()


@dataclass(frozen=True, slots=True)
class OllamaName:
    """An ollama model name, parsed as ollama's `types/model/name.go` `ParseName` does:
    `[host/][namespace/]model[:tag]`, missing parts filled with registry.ollama.ai, library, latest."""

    host: str
    namespace: str
    model: str
    tag: str

    @classmethod
    def parse(cls, text: str) -> OllamaName | None:
        """The name, or None when `text` is not a valid one."""
        rest, tag = re.sub(r"^https?://", "", text), OLLAMA_TAG
        if rest.rfind(":") > rest.rfind("/"):  # "/" cannot appear in a tag; a host may have ":port"
            rest, _, tag = rest.rpartition(":")
        pieces = rest.split("/")
        if len(pieces) > 3:
            return None
        host, namespace, model = [OLLAMA_HOST, OLLAMA_NAMESPACE][: 3 - len(pieces)] + pieces
        name = cls(host, namespace, model, tag)
        return name if all(_valid_part(kind, part) for kind, part in name._parts()) else None

    def _parts(self) -> tuple[tuple[str, str], ...]:
        return (("host", self.host), ("namespace", self.namespace), ("model", self.model), ("tag", self.tag))

    @property
    def filepath(self) -> Path:
        """Where the manifest lies under `manifests/`."""
        return Path(self.host, self.namespace, self.model, self.tag)

    def display(self) -> str:
        """The shortest form, as ollama's DisplayShortest: `qwen3.5:4b`, `user/model:tag`."""
        prefix = ""
        if self.host.lower() != OLLAMA_HOST:
            prefix = f"{self.host}/{self.namespace}/"
        elif self.namespace.lower() != OLLAMA_NAMESPACE:
            prefix = f"{self.namespace}/"
        return f"{prefix}{self.model}:{self.tag}"


def _valid_part(kind: str, part: str) -> bool:
    """name.go's isValidPart: an alphanumeric or "_" first, then those, "-" and "." ("." not in a
    namespace, ":" only in a host); 1..80 characters (a host up to 350)."""
    if not 1 <= len(part) <= (350 if kind == "host" else 80):
        return False
    allowed = "_-" + ("" if kind == "namespace" else ".") + (":" if kind == "host" else "")
    return (part[0].isascii() and (part[0].isalnum() or part[0] == "_")) and all(
        c.isascii() and (c.isalnum() or c in allowed) for c in part[1:]
    )


def _find_manifest(manifests: Path, name: OllamaName) -> Path | None:
    """The manifest file of `name`; parts compared ignoring case, as ollama compares names."""
    exact = manifests / name.filepath
    if exact.is_file():
        return exact
    folder = manifests
    for part in name.filepath.parts:
        if not folder.is_dir():
            return None
        folder = next((p for p in folder.iterdir() if p.name.lower() == part.lower()), folder / part)
    return folder if folder.is_file() else None


def _from_ollama(name: OllamaName, manifest_path: Path, store: Path) -> ResolvedModel:
    shown = name.display()
    try:
        manifest = json.loads(manifest_path.read_text())
        layers = [layer for layer in manifest["layers"] if isinstance(layer, dict)]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelNotFound(f"ollama model {shown}: cannot read its manifest {manifest_path}: {e}") from None

    def blob(layer: Mapping[str, Any]) -> Path:
        match = _DIGEST.match(str(layer.get("digest", "")))
        if match is None:
            raise ModelNotFound(f"ollama model {shown}: bad digest {layer.get('digest')!r} in {manifest_path}")
        path = store / "blobs" / f"sha256-{match['hex']}"
        if not path.is_file():
            raise ModelNotFound(
                f"ollama model {shown}: blob {path} (named by {manifest_path}) is missing; `ollama pull {shown}`"
            )
        if isinstance(layer.get("size"), int) and path.stat().st_size != layer["size"]:
            size = path.stat().st_size
            raise ModelNotFound(
                f"ollama model {shown}: blob {path} has {size} bytes, its manifest says {layer['size']}"
            )
        return path

    kinds = {str(layer.get("mediaType", "")).removeprefix(_OLLAMA_LAYER): layer for layer in reversed(layers)}
    if "adapter" in kinds:
        raise NotSupported(f"ollama model {shown} applies a LoRA adapter layer; hybridkv does not apply adapters")
    model_layer = next((layer for layer in layers if layer.get("mediaType") == OLLAMA_MODEL_LAYER), None)
    if model_layer is None:
        found = ", ".join(sorted(kinds)) or "none"
        if "tensor" in kinds:  # ollama's per-tensor safetensors/MLX layout, not a GGUF
            raise NotSupported(f"ollama model {shown} stores its weights as per-tensor layers, not one GGUF")
        raise ModelNotFound(
            f"ollama model {shown}: {manifest_path} has no {OLLAMA_MODEL_LAYER} layer (layers: {found})"
        )
    gguf = blob(model_layer)
    _check_gguf(gguf, f"ollama model {shown}'s blob {gguf}")

    notes: list[str] = []
    defaults: dict[str, Any] = {}
    if "params" in kinds:
        defaults, unused = _ollama_sampling(blob(kinds["params"]))
        if unused:
            notes.append(f"ollama params not applied: {', '.join(unused)}")
    if "projector" in kinds:
        notes.append("the vision projector layer is ignored: hybridkv runs text only")
    if "system" in kinds:
        notes.append("the default system message layer is ignored: pass the system message in the request")
    size = gguf.stat().st_size / 1e9
    return ResolvedModel(
        "ollama",
        gguf,
        shown,
        f"ollama {shown} ({gguf}, {size:.1f} GB)",
        (gguf,),
        MappingProxyType(defaults),
        tuple(notes),
    )


def _ollama_sampling(path: Path) -> tuple[dict[str, Any], list[str]]:
    """SamplingParams defaults from an ollama params blob, and the params that have none."""
    try:
        params = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelNotFound(f"ollama params blob {path} is not JSON: {e}") from None
    defaults: dict[str, Any] = {}
    unused: list[str] = []
    for key, value in params.items() if isinstance(params, dict) else ():
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if key == "stop" and isinstance(value, list) and all(isinstance(s, str) and s for s in value):
            defaults["stop"] = tuple(value)
        elif key == "num_predict" and number and value < 0:
            pass  # -1, -2: no limit
        elif key in _OLLAMA_SAMPLING and number and (key not in _INTEGERS or value == int(value)):
            defaults[_OLLAMA_SAMPLING[key]] = int(value) if key in _INTEGERS else value
        else:
            unused.append(f"{key}={value!r}")
    return defaults, unused


# -- Hugging Face cache --------------------------------------------------------------------------


def hf_cache_dir() -> Path:
    """huggingface_hub's cache, from the environment now (its `constants` are read at import)."""
    env = os.environ
    if cache := env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
        return Path(cache).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home, "hub").expanduser()


def _from_hf_cache(text: str, tried: list[str]) -> ResolvedModel | None:
    """The cached snapshot of repo id `text` (`ORG/NAME[@revision]`), or None with what was tried."""
    repo_id, _, revision = text.partition("@")
    cache = hf_cache_dir()
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.utils import validate_repo_id
    except ImportError:
        tried.append("the Hugging Face cache was not searched (install huggingface_hub)")
        return None
    try:
        validate_repo_id(repo_id)
    except ValueError:
        tried.append("not a Hugging Face repo id")
        return None
    where = f"{repo_id}" + (f" at revision {revision}" if revision else "")
    try:
        folder = snapshot_download(repo_id, revision=revision or None, cache_dir=cache, local_files_only=True)
    except (ValueError, OSError) as e:  # not cached (LocalEntryNotFoundError), incomplete, a bad revision
        detail = "" if type(e).__name__ == "LocalEntryNotFoundError" else ": " + " ".join(str(e).split())
        tried.append(f"no snapshot of {where} in the Hugging Face cache {cache}{detail}")
        return None
    resolved = _from_path(Path(str(folder)), "hf", repo_id)
    return replace(resolved, description=f"Hugging Face {where} ({resolved.path})")
