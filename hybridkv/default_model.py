"""The model hybridkv runs when none is named: a tiny Qwen3-Next trained by the project, shipped in the package.

`hybridkv/assets/default_model/` holds what a Hugging Face checkpoint holds — `config.json`,
`model.safetensors` under the released tensor names, `tokenizer.json`, `tokenizer_config.json`
(with a ChatML chat template), `generation_config.json` — so the same code path loads it and a
real checkpoint. It was trained on the Python 3.11 documentation by
`scripts/train_default_model.py`; README.md ("The default model") says what it is and how well
it does.
"""

from __future__ import annotations

from pathlib import Path


def default_model_dir() -> Path:
    """The shipped default model's directory."""
    return Path(__file__).parent / "assets" / "default_model"
