"""The model families, found by the `family` their config.json's `model_type` names, and loading.

A family is one file in `models/` (its model class and its checkpoint mapping) plus one entry
here; nothing outside `models/` names a family.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridkv.errors import NotSupported
from hybridkv.models import gguf_blocks, qwen3_5, qwen3_next
from hybridkv.models.config import ModelConfig
from hybridkv.models.gguf_checkpoint import GGUFCheckpoint, GGUFTensors
from hybridkv.models.mtp import MTPHidden, mtp_layout
from hybridkv.models.quantize import quantize_model, quantize_type
from hybridkv.models.qwen3_next import Qwen3NextModel
from hybridkv.models.weights import Checkpoint, Layout, TensorSource, load_weights
from hybridkv.ops import pages
from hybridkv.ops.malloc import give_back_freed_memory


def _as_is(config: ModelConfig, names: set[str]) -> ModelConfig:
    return config


@dataclass(frozen=True, slots=True)
class Family:
    """What loading needs to know about a family.

    `for_checkpoint(config, names)`: the config adjusted to what the files hold (Qwen3.5 ties the
    head exactly when `lm_head.weight` is absent). `checkpoint_layout(config, names)`: our
    parameters from checkpoint tensors. `is_ignored(config, name)`: checkpoint tensors neither
    loaded nor counted in the memory check.
    """

    model_class: type[Qwen3NextModel]
    checkpoint_layout: Callable[[ModelConfig, set[str]], Layout]
    is_ignored: Callable[[ModelConfig, str], bool]
    for_checkpoint: Callable[[ModelConfig, set[str]], ModelConfig] = _as_is


FAMILIES: dict[str, Family] = {
    "qwen3_next": Family(Qwen3NextModel, qwen3_next.checkpoint_layout, qwen3_next.is_ignored),
    "qwen3_5": Family(qwen3_5.Qwen3_5Model, qwen3_5.checkpoint_layout, qwen3_5.is_ignored, qwen3_5.for_checkpoint),
}


def read_checkpoint(model_dir: str | Path, keep_tiled: bool = False) -> tuple[ModelConfig, TensorSource]:
    """The config (as the files have it) and the tensors of a checkpoint directory, or of a GGUF
    file (the first of a split set), seen as the Hugging Face checkpoint it was converted from
    (`keep_tiled`: qwen35's value heads in the file's order, see `gguf_blocks`)."""
    checkpoint: TensorSource
    if Path(model_dir).is_file():
        checkpoint = GGUFCheckpoint(GGUFTensors(model_dir), keep_tiled)
        config = ModelConfig.from_dict(checkpoint.hf_config, source=str(model_dir))
    else:
        config = ModelConfig.from_dir(model_dir)
        checkpoint = Checkpoint(model_dir)
    return FAMILIES[config.family].for_checkpoint(config, checkpoint.names), checkpoint


def weights_nbytes(model_dir: str | Path, dtype: torch.dtype, keep_blocks: bool = True, mtp: bool = False) -> int:
    """Bytes the weights a model loads from `model_dir` (a directory or a GGUF file) occupy once
    loaded: cast to `dtype`, except a GGUF file's tensors kept in their blocks (`keep_blocks`);
    with `mtp`, the multi-token-prediction block's tensors too."""
    config, checkpoint = read_checkpoint(model_dir)
    family = FAMILIES[config.family]
    itemsize = torch.empty((), dtype=dtype).element_size()

    def loaded(name: str) -> bool:
        return not family.is_ignored(config, name) or (mtp and name.startswith("mtp."))

    total = sum(checkpoint.numel(name) * itemsize for name in checkpoint.names if loaded(name))
    if keep_blocks and isinstance(checkpoint, GGUFCheckpoint) and isinstance(checkpoint.source, GGUFTensors):
        tensors = checkpoint.source.file.tensors
        for pieces in gguf_blocks.block_layout(checkpoint.source, config).values():
            for info in (tensors[p.name] for p in pieces):
                if gguf_blocks.kept_in_blocks(info.type_id):
                    total -= info.n_elements * itemsize - info.n_bytes
    return total


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    keep_blocks: bool = True,
    quantize: str | None = None,
    mtp: MTPHidden | None = None,
) -> Qwen3NextModel:
    """Build the model of a Hugging Face checkpoint directory or a GGUF file, weights cast to `dtype`.

    A GGUF file's projections stay in their blocks where the type has a kernel (`gguf_blocks`);
    `keep_blocks=False` dequantizes everything at load instead. `quantize` ('q8_0') quantizes the
    float weights after loading (`models.quantize`). `mtp` also loads the checkpoint's
    multi-token-prediction block, fed the hidden state it names (`models.mtp`).
    """
    type_id = quantize_type(quantize) if quantize is not None else None
    config, checkpoint = read_checkpoint(model_dir, keep_tiled=keep_blocks)
    family = FAMILIES[config.family]
    if mtp is not None:
        check_mtp(config, checkpoint)
    model = family.model_class(config, dtype, mtp)
    layout = family.checkpoint_layout(config, checkpoint.names)
    if mtp is not None:
        layout.update(mtp_layout(config, checkpoint.names))
    params: dict[str, torch.Tensor] = dict(model.named_parameters())
    held: set[str] = set()
    if keep_blocks and isinstance(checkpoint, GGUFCheckpoint) and isinstance(checkpoint.source, GGUFTensors):
        replaced = gguf_blocks.attach(model, checkpoint.source, config, dtype)
        held = {piece.name for name in replaced for piece in layout.pop(name)}
        params = {name: p for name, p in params.items() if name not in replaced}
    if isinstance(checkpoint, GGUFCheckpoint) and checkpoint.tiled:
        for layer in model.layers:
            if isinstance(layer.mixer, qwen3_next.GatedDeltaNet):
                layer.mixer.tiled_heads = True
    load_weights(params, layout, checkpoint, lambda name: family.is_ignored(config, name) or name in held)
    if type_id is not None:
        quantize_model(model, type_id)
    # Weights streamed every step are read through 2 MiB pages, not 4 KiB ones: copied once; a
    # GGUF file's pages, which the copies replace, are released so the weights are resident once.
    if pages.move(model.weight_tensors()):
        if isinstance(checkpoint, GGUFCheckpoint) and isinstance(checkpoint.source, GGUFTensors):
            checkpoint.source.file.release_all()
        give_back_freed_memory()
    return model.eval()


def check_mtp(config: ModelConfig, checkpoint: TensorSource) -> None:
    """Raise NotSupported unless the checkpoint holds one MTP layer hybridkv can load."""
    where = checkpoint.description
    if isinstance(checkpoint, GGUFCheckpoint):
        raise NotSupported(f"{where}: MTP drafting from GGUF files is not supported; use a safetensors checkpoint")
    if config.mtp_num_hidden_layers < 1:
        raise NotSupported(
            f"{where}: this checkpoint has no multi-token-prediction block (config.json sets neither "
            "mtp_num_hidden_layers nor num_nextn_predict_layers); draft with n-grams instead"
        )
    if config.mtp_num_hidden_layers > 1:
        raise NotSupported(f"{where}: {config.mtp_num_hidden_layers} MTP layers; hybridkv drafts with one")
