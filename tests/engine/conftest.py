from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from chat_model import write_chat_model


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    return write_chat_model(tmp_path_factory.mktemp("chat-model"))
