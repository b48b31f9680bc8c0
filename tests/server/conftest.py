"""Fixtures: the tiny chat model, and one server for the whole session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from engine.chat_model import write_chat_model
from served import Served, make_llm, start, stop


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_chat_model(tmp_path_factory.mktemp("server-model"))[0]


@pytest.fixture(scope="session")
def served(model_dir: Path) -> Iterator[Served]:
    served, thread = start(make_llm(model_dir))
    yield served
    stop(served, thread)
