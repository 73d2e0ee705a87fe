"""What every part of the Semantic Router translation shares: the result it builds and the shape checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from farm.config.base import ConfigError

NOT_HERE = "the farm runs its own models for this"


@dataclass
class VsrImport:
    """The farm configuration override translated from a Semantic Router config, and what did not carry over."""

    config: dict[str, Any]
    unmapped: list[str] = field(default_factory=list)  # "key: why it has no equivalent", one per key
    notes: list[str] = field(default_factory=list)  # keys that map, but not one to one

    def skip(self, key: str, why: str) -> None:
        self.unmapped.append(f"{key}: no equivalent ({why})")


def mapping(v: Any, key: str) -> dict[str, Any]:
    """`v` as a mapping (None: empty); anything else is an error naming `key`."""
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ConfigError(f"{key}: expected a mapping, got {type(v).__name__}")
    return v


def items(v: Any, key: str) -> list[Any]:
    """`v` as a list (None: empty); anything else is an error naming `key`."""
    if v is None:
        return []
    if not isinstance(v, list):
        raise ConfigError(f"{key}: expected a list, got {type(v).__name__}")
    return v
