"""The test configs: small copies of public models' published config.json files (cache keys kept,
weights-only keys such as quantization and auto_map left out), written by hand."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvroute.engines.models import ModelSpec, model_spec, normalize, read_json

CONFIGS = Path(__file__).resolve().parent / "configs"


def path(name: str) -> Path:
    return CONFIGS / f"{name}.json"


def raw(name: str) -> dict[str, Any]:
    return read_json(path(name))


def spec(name_or_mapping: str | dict[str, Any]) -> ModelSpec:
    mapping = raw(name_or_mapping) if isinstance(name_or_mapping, str) else name_or_mapping
    return model_spec(normalize(mapping))
