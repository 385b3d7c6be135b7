"""Which attention layers a config's ``sliding_window`` applies to, as the engines apply it.

A config either names each layer's type (``layer_types``: Gemma 3, GPT-OSS, and every class
transformers fills it in for) or leaves it to the model type. vLLM 0.34 sets its model-level window
(``CacheConfig.sliding_window``) only when ``layer_types`` is absent or all ``sliding_attention``,
and a layer built without a per-layer window takes that model-level one; the rules below are what
that gives for each model type whose config carries a window without ``layer_types``:

- ``mistral``, ``mixtral``, ``phi3``, ``phimoe``: every layer;
- ``qwen3_moe`` with ``use_sliding_window``: every layer;
- ``qwen2`` and ``qwen3`` with ``use_sliding_window``: layers from ``max_window_layers`` on (the
  ``layer_types`` their transformers classes fill in), and ``qwen2_moe``: the even layers below
  ``max_window_layers`` (likewise). The Qwen families' window is off unless ``use_sliding_window``.

Some model types take only the model-level window (``MODEL_LEVEL_ONLY``): their vLLM attention
layers are built without a per-layer window, so a window on some layers and not others is never
what the engine runs (vLLM's Qwen2 refuses to start, the others keep every token in every layer); pre-flight refuses it, naming the key, rather than register a cache the engine
does not keep. Any other model type with a window and no ``layer_types`` is refused as well: its
rule is not known here, and a guess would be a wrong registration.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvroute.engines.models.errors import UnsupportedConfig

Rule = Callable[[Mapping[str, Any], int], tuple[int, ...]]


def _every_layer(lm: Mapping[str, Any], num_layers: int) -> tuple[int, ...]:
    return tuple(range(num_layers))


def _first_window_layer(lm: Mapping[str, Any], num_layers: int) -> int:
    value = lm.get("max_window_layers")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        reason = "is required" if value is None else f"must be a count, got {value!r}"
        raise UnsupportedConfig("max_window_layers", f"{reason} with use_sliding_window")
    return value


def _from_max_window_layers(lm: Mapping[str, Any], num_layers: int) -> tuple[int, ...]:
    return tuple(range(_first_window_layer(lm, num_layers), num_layers))


def _even_below_max_window_layers(lm: Mapping[str, Any], num_layers: int) -> tuple[int, ...]:
    first = _first_window_layer(lm, num_layers)
    return tuple(i for i in range(min(first, num_layers)) if (i + 1) % 2)


# model type -> (the window applies only with use_sliding_window, the layers it applies to)
RULES: Mapping[str, tuple[bool, Rule]] = {
    "mistral": (False, _every_layer),
    "mixtral": (False, _every_layer),
    "phi3": (False, _every_layer),
    "phimoe": (False, _every_layer),
    "qwen3_moe": (True, _every_layer),
    "qwen2": (True, _from_max_window_layers),
    "qwen3": (True, _from_max_window_layers),
    "qwen2_moe": (True, _even_below_max_window_layers),
}
USE_KEY = "use_sliding_window"
MODEL_LEVEL_ONLY = frozenset({"qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "mixtral", "phimoe"})


def rule_windowed(lm: Mapping[str, Any], num_layers: int) -> tuple[int, ...]:
    """The layers (of all ``num_layers``) a window without ``layer_types`` applies to."""
    window = lm.get("sliding_window")
    model_type = lm.get("model_type")
    rule = RULES.get(model_type) if isinstance(model_type, str) else None
    if rule is None:
        if not window or lm.get(USE_KEY) is False:
            return ()
        known = ", ".join(sorted(RULES))
        raise UnsupportedConfig(
            "sliding_window",
            f"set, but the config does not say which layers use it (no layer_types) and model "
            f"type {model_type!r} has no rule kvroute knows (known: {known}); install "
            "kvroute[models] so transformers fills in the model's default, or add layer_types",
        )
    needs_flag, layers = rule
    if not window or (needs_flag and lm.get(USE_KEY) is not True):
        return ()
    return layers(lm, num_layers)


def check_engine_runs(
    lm: Mapping[str, Any], windowed: Sequence[int], attention: Sequence[int], key: str
) -> None:
    """Refuses a window on some attention layers of a model type that takes only one window."""
    model_type = lm.get("model_type")
    covered = [layer for layer in attention if layer in set(windowed)]
    if model_type in MODEL_LEVEL_ONLY and 0 < len(covered) < len(attention):
        raise UnsupportedConfig(
            "max_window_layers" if lm.get("max_window_layers") is not None else key,
            f"windows {len(covered)} of {len(attention)} attention layers; vLLM's {model_type} "
            "takes one model-level window for every layer or none (Qwen2 refuses to start, the "
            "others keep every token), so no engine cache matches the config",
        )
