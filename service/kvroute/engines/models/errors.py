"""What a model's config or parallel layout can make kvroute refuse: the key and the reason."""

from __future__ import annotations


class ModelRefusal(ValueError):
    """A refusal naming the config key it is about and the reason."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}")
        self.key = key
        self.reason = reason


class UnsupportedConfig(ModelRefusal):
    """A config kvroute cannot describe: the key and the reason."""


class UnsupportedLayout(ModelRefusal):
    """A parallel layout the model cannot run with (the key of the config and the reason)."""
