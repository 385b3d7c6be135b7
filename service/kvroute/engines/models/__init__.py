"""Registration documents and pre-flight verdicts from Hugging Face model configs.

``source`` reads a config (transformers' ``AutoConfig`` when the ``models`` extra is installed),
``config`` turns its mapping into the cache facts kvroute needs (or refuses, naming the key),
``layout`` parses a parallel layout, ``documents`` writes every rank's registration document and
``preflight`` admits two instances' documents as a fresh deployment would and plans them.
"""

from kvroute.engines.models.config import ModelSpec, model_spec
from kvroute.engines.models.documents import rank_documents
from kvroute.engines.models.errors import UnsupportedConfig, UnsupportedLayout
from kvroute.engines.models.layout import Layout, LayoutError, parse_layout
from kvroute.engines.models.preflight import Instance, Verdict, admit, describe, summary
from kvroute.engines.models.source import load_config, normalize, read_json

__all__ = [
    "Instance",
    "Layout",
    "LayoutError",
    "ModelSpec",
    "UnsupportedConfig",
    "UnsupportedLayout",
    "Verdict",
    "admit",
    "describe",
    "load_config",
    "model_spec",
    "normalize",
    "parse_layout",
    "rank_documents",
    "read_json",
    "summary",
]
