"""Reading a model config: a local ``config.json`` (or its directory), offline, or a pasted mapping.

With the ``models`` extra (``transformers``, which needs no torch for configs) the mapping is
``AutoConfig(...).to_dict()``: the model class's defaults filled in where the published file leaves
them out. Without transformers, or for a model type the installed transformers does not know
(DeepSeek-V3.2's ``deepseek_v32``), the file's own mapping is used; ``config.model_spec`` reads both
the same way and refuses what the plain file leaves open rather than guessing it. Nothing is ever
fetched: ``local_files_only`` and a path that must exist.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvroute.engines.models.errors import UnsupportedConfig


def read_json(path: Path) -> dict[str, Any]:
    """The mapping in ``path`` (a config.json, or a directory holding one)."""
    file = path / "config.json" if path.is_dir() else path
    try:
        mapping = json.loads(file.read_text())
    except OSError as error:
        raise UnsupportedConfig(str(file), f"cannot read it: {error.strerror}") from error
    except json.JSONDecodeError as error:
        raise UnsupportedConfig(str(file), f"is not JSON: {error}") from error
    if not isinstance(mapping, dict):
        raise UnsupportedConfig(str(file), "must hold a JSON object")
    return mapping


def normalize(mapping: Mapping[str, Any]) -> dict[str, Any]:
    """``AutoConfig.for_model(**mapping).to_dict()`` where transformers knows the model type,
    else the mapping as it is."""
    auto = _auto_config()
    model_type = mapping.get("model_type")
    if auto is None or not isinstance(model_type, str):
        return dict(mapping)
    fields = {key: value for key, value in mapping.items() if key != "model_type"}
    try:
        config = auto.for_model(model_type, **fields)
    except Exception:  # an unknown model type, or values its class rejects: the plain mapping,
        return dict(mapping)  # which model_spec checks key by key and refuses by name

    return dict(config.to_dict())


def load_config(path: Path) -> dict[str, Any]:
    """A local config read as transformers reads it (offline), or its plain mapping."""
    mapping = read_json(path)
    auto = _auto_config()
    if auto is None:
        return mapping
    try:
        config = auto.from_pretrained(str(path), local_files_only=True)
    except Exception:  # as in normalize: the plain mapping, read by the same rules
        return mapping
    return dict(config.to_dict())


def _auto_config() -> Any:
    try:
        from transformers import AutoConfig
    except ImportError:
        return None
    return AutoConfig
