"""Every bound of a registration document, in one place: the parser checks these, the spec states them.

The limits fit the largest public models with headroom, so a real deployment never meets them and a
hostile document is refused before it costs anything:

- layers: 1024 per model and per view (Llama 3.1 405B has 126, PaLM 540B 118, MT-NLG 530B 105,
  DeepSeek-V3 61); a rank lists at most 4096 layer slots over all its views (four role classes per
  layer of a 1024-layer model, e.g. K+V, indexer keys and their scales), and layer ids stay below
  1024 in both the target and the draft namespace;
- KV heads: 1024 per view (KV heads never exceed query heads; the most query heads of a public model
  are Falcon-180B's 232, GPT-3 and OPT-175B have 96);
- parallel sizes: 1024 for TP, PP, DP and CP (GB200 NVL72 gives TP72; DeepSeek-V3 decode runs
  attention DP over 320 GPUs); ranks are numbered ``0..size-1``;
- pools: 64 per rank, ids below 1024; views: 256 per rank (a K view and a V view for each of
  Llama 3.1 405B's 126 layers is 252), ids below 4096; 16 roles per view;
- bytes: 1 TiB for any byte count or offset (beyond any GPU's memory);
- recurrent state: 16 conv sections per view (Mamba2 has three, ``[x | B | C]``, GDN three,
  ``[Q | K | V]``); sliding windows up to 2**30 tokens (far past any context length).

``api_spec/openapi.yaml`` states the same numbers; ``tests/unit/test_limits.py`` checks every entry
of ``INTEGER_BOUNDS`` and ``ARRAY_BOUNDS`` against it.
"""

from __future__ import annotations

MAX_LAYERS = 1024
MAX_LAYER_SLOTS = 4 * MAX_LAYERS  # layer entries over all views of one rank
MAX_KV_HEADS = 1024
MAX_PARALLEL = 1024
MAX_POOLS = 64
MAX_POOL_ID = 1023
MAX_VIEWS = 256
MAX_VIEW_ID = 4095
MAX_ROLES = 16
MAX_BYTES = 2**40
MAX_TOKENS_PER_BLOCK = 2**20
MAX_HEAD_DIM = 2**16
MAX_BUFFERS_PER_LAYER = 64
MAX_LEASE_SECONDS = 86_400
MAX_ENDPOINT_LENGTH = 512
MAX_NIXL_METADATA_LENGTH = 1 << 20
MAX_CONV_SECTIONS = 16
MAX_SLIDING_WINDOW = 2**30
MAX_KV_GROUP = 1023  # an engine's KV cache group ids (vLLM numbers a handful from 0)
MAX_IDENTITY_LENGTH = 256  # model ids, revisions, "sha256:<64 hex>" digests
MAX_FORMAT_LENGTH = 32  # KV and scale format names
MAX_DOMAINS = 8  # topology domains per rank (zone, rack, NVLink domain, ...)

# "Schema.property" (``[]`` for an array's items) -> inclusive (minimum, maximum).
INTEGER_BOUNDS: dict[str, tuple[int, int]] = {
    "RegistrationDocument.tp_size": (1, MAX_PARALLEL),
    "RegistrationDocument.tp_rank": (0, MAX_PARALLEL - 1),
    "RegistrationDocument.pp_size": (1, MAX_PARALLEL),
    "RegistrationDocument.pp_rank": (0, MAX_PARALLEL - 1),
    "RegistrationDocument.cp_size": (1, MAX_PARALLEL),
    "RegistrationDocument.cp_rank": (0, MAX_PARALLEL - 1),
    "RegistrationDocument.cp_interleave": (1, MAX_TOKENS_PER_BLOCK),
    "RegistrationDocument.dp_size": (1, MAX_PARALLEL),
    "RegistrationDocument.dp_rank": (0, MAX_PARALLEL - 1),
    "RegistrationDocument.layers_per_stage[]": (0, MAX_LAYERS),
    "RegistrationDocument.num_draft_layers": (0, MAX_LAYERS),
    "RegistrationDocument.tokens_per_block": (1, MAX_TOKENS_PER_BLOCK),
    "RegistrationDocument.lease_seconds": (1, MAX_LEASE_SECONDS),
    "Attention.num_kv_heads": (1, MAX_KV_HEADS),
    "Attention.head_dim": (1, MAX_HEAD_DIM),
    "Pool.pool_id": (0, MAX_POOL_ID),
    "Pool.slot_bytes": (1, MAX_BYTES),
    "Pool.slot_stride": (1, MAX_BYTES),
    "Pool.num_slots": (1, MAX_BYTES),
    "View.view_id": (0, MAX_VIEW_ID),
    "View.pool_id": (0, MAX_POOL_ID),
    "View.num_kv_heads": (1, MAX_KV_HEADS),
    "View.total_kv_heads": (1, MAX_KV_HEADS),
    "View.buffers_per_layer": (1, MAX_BUFFERS_PER_LAYER),
    "View.bytes_per_layer": (1, MAX_BYTES),
    "View.tokens_per_block": (1, MAX_TOKENS_PER_BLOCK),
    "View.ssm_bytes_per_head": (1, MAX_BYTES),
    "View.conv_sections[]": (1, MAX_BYTES),
    "View.sliding_window": (1, MAX_SLIDING_WINDOW),
    "View.kv_group": (0, MAX_KV_GROUP),
    "Tiling.planes": (1, MAX_HEAD_DIM),
    "Tiling.token_group": (1, MAX_TOKENS_PER_BLOCK),
    "Tiling.group_planes": (1, MAX_HEAD_DIM),
    "View.layers[].layer": (0, MAX_LAYERS - 1),
    "View.layers[].offset": (0, MAX_BYTES),
    "KvQuantization.scale_block": (1, MAX_HEAD_DIM),
}

# "Schema.property" -> inclusive (minItems, maxItems) of an array.
ARRAY_BOUNDS: dict[str, tuple[int, int]] = {
    "RegistrationDocument.layers_per_stage": (1, MAX_PARALLEL),
    "RegistrationDocument.pools": (1, MAX_POOLS),
    # The contract asks for a view; the library also reads the rank of an empty PP stage (none).
    "RegistrationDocument.views": (1, MAX_VIEWS),
    "View.roles": (1, MAX_ROLES),
    "View.layers": (1, MAX_LAYERS),
    "View.conv_sections": (1, MAX_CONV_SECTIONS),
    "Interior.tilings": (1, MAX_BUFFERS_PER_LAYER),
}

# "Schema.property" -> inclusive (minLength, maxLength) of a string.
STRING_BOUNDS: dict[str, tuple[int, int]] = {
    "RegistrationDocument.endpoint": (1, MAX_ENDPOINT_LENGTH),
    "RegistrationDocument.nixl_agent_metadata": (0, MAX_NIXL_METADATA_LENGTH),
    **{
        f"ModelIdentity.{key}": (1, MAX_IDENTITY_LENGTH)
        for key in ("name", "revision", "weights_digest", "tokenizer_digest")
    },
    "KvQuantization.kv_dtype": (1, MAX_FORMAT_LENGTH),
    "KvQuantization.scale_dtype": (1, MAX_FORMAT_LENGTH),
}
