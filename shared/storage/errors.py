"""The one error type of the storage layer (its own module so `storage` and `storage.safety` share it)."""

from __future__ import annotations


class StorageError(OSError):
    """A storage operation failed in a way the user can fix (missing file, bad URI, no credentials)."""
