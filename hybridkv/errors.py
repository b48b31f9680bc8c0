"""Errors hybridkv raises instead of falling back silently."""

from __future__ import annotations


class CacheFull(RuntimeError):
    """The cache has no room for what was asked; nothing was changed. Wait, free or preempt."""


class NotSupported(RuntimeError):
    """A feature, file or operation hybridkv does not handle; the message says what and why."""


class IntegrityError(AssertionError):
    """Cache bookkeeping contradicts itself (a bug, never a user error)."""
