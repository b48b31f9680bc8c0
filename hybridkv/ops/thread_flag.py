"""A switch that holds per thread and for a block: `ops.quant.linear.float_activations`,
`models.qwen3_next.layers_op_by_op`."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class ThreadFlag:
    """False in every thread until a `set()` block of that thread; nested blocks restore it."""

    def __init__(self) -> None:
        self._local = threading.local()

    def __bool__(self) -> bool:
        return bool(getattr(self._local, "on", False))

    @contextlib.contextmanager
    def set(self) -> Iterator[None]:
        before = bool(self)
        self._local.on = True
        try:
            yield
        finally:
            self._local.on = before
