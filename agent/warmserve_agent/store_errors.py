"""How the weight store says no: its errors, below both the store and its layout upgrade."""

from __future__ import annotations


class StoreError(ValueError):
    """A model missing from or malformed in the weight store (message says what to fix)."""


class UnknownModel(StoreError):
    pass
