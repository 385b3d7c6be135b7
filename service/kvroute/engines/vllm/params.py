"""What a KvrouteConnector reads from its configuration and writes into ``kv_transfer_params``.

``Settings`` comes from ``kv_connector_extra_config``; ``Handover`` is the part of a request's
``kv_transfer_params`` that a proxy carries from the producer's answer to the consumer's request,
the same way users already hand a request over with vLLM's NixlConnector.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ROLES = {"kv_producer": "context", "kv_consumer": "generation"}
DONE_PREFIX = "kvroute-done"  # NIXL notification a consumer rank sends each producer rank
# "endpoint": the engine's OpenAI address, for ``kvroute proxy`` (kept by kvroute as given).
PASSED_MEMBERS = ("model", "kv_quantization", "topology", "endpoint")


@dataclass(frozen=True, slots=True)
class Settings:
    """``kv_connector_extra_config``: where kvroute is and what this engine is called there."""

    url: str
    deployment: str
    instance: str
    role: str  # kvroute's role: "context" (producer) or "generation" (consumer)
    token: str | None = None
    lease_seconds: int = 30
    pull_timeout_s: float = 30.0  # a pull still running after this is a load error
    send_timeout_s: float = 120.0  # a producer frees blocks no consumer pulled after this
    # How far a consumer's wall clock may run behind its producers': a hand-over is treated as
    # expired this long before the producer's stated end of hold (``Handover.expires_at``).
    clock_skew_s: float = 1.0
    kv_cache_layout: str | None = "BLHNC"  # asked of vLLM: one pool, all layers of a block together
    # Registration members passed through as given (kvroute checks them): the model's identity
    # ("model": {"name", "revision", ...}), its KV quantization and the engine's topology domains.
    members: tuple[tuple[str, Any], ...] = ()
    # Sampled KV digests (``digests``): the share of a producer's requests digested and checked by
    # their consumers (0: off), and the tokens each digest covers.
    kv_digest_rate: float = 0.0
    kv_digest_chunk: int = 1024
    # A sliding window's series are cut every this many tokens, counted back from the prompt's end
    # (``client.kv_digest.Grid``): the two sides hold windows from different tokens, and only
    # the span straddling the later start goes uncompared (0: by ``kv_digest_chunk``, as the rest).
    kv_digest_window_step: int = 64
    # NIXL's progress thread (its default, and vLLM's NixlConnector's): it serves a peer's reads
    # where the transport needs the holder's progress (UCX over TCP). It polls without pause, a
    # whole core per rank even while idle (measured: 97 % of a core; 0 % without it). Without it
    # this rank progresses its own reads when it checks them and the holder's side when it polls
    # its notifications, every engine step: enough on one host (shared memory) and over RDMA.
    nixl_progress_thread: bool = True

    @classmethod
    def from_config(cls, kv_role: str | None, extra: Mapping[str, Any]) -> Settings:
        missing = [key for key in ("url", "deployment", "instance") if not extra.get(key)]
        if missing:
            raise ValueError(
                f"kv_connector_extra_config needs {missing} for KvrouteConnector "
                '(e.g. {"url": "http://kvroute:8080", "deployment": "llama", "instance": "prefill0"})'
            )
        role = extra.get("role") or (ROLES.get(kv_role) if kv_role is not None else None)
        if role not in ("context", "generation"):
            raise ValueError(
                f"kv_role {kv_role!r} does not say whether this engine sends or receives: use "
                'kv_producer or kv_consumer, or set "role": "context"|"generation" in '
                "kv_connector_extra_config"
            )
        return cls(
            url=str(extra["url"]),
            deployment=str(extra["deployment"]),
            instance=str(extra["instance"]),
            role=role,
            token=extra.get("token"),
            lease_seconds=int(extra.get("lease_seconds", 30)),
            pull_timeout_s=float(extra.get("pull_timeout_s", 30.0)),
            send_timeout_s=float(extra.get("send_timeout_s", 120.0)),
            clock_skew_s=float(extra.get("clock_skew_s", 1.0)),
            kv_cache_layout=extra.get("kv_cache_layout", "BLHNC"),
            members=tuple((key, extra[key]) for key in PASSED_MEMBERS if extra.get(key)),
            kv_digest_rate=_rate(extra.get("kv_digest_rate", 0.0)),
            kv_digest_chunk=int(extra.get("kv_digest_chunk", 1024)),
            kv_digest_window_step=_count(extra.get("kv_digest_window_step", 64)),
            nixl_progress_thread=_flag(
                "nixl_progress_thread", extra.get("nixl_progress_thread", True)
            ),
        )

    def registration_members(self) -> dict[str, Any]:
        """What the rank's registration document gains from the configuration (only what is set:
        older kvroute servers refuse unknown members)."""
        return {key: value for key, value in self.members}

    @property
    def producer(self) -> bool:
        return self.role == "context"


def _rate(value: Any) -> float:
    rate = float(value)
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"kv_digest_rate must lie in [0, 1], got {value!r}")
    return rate


def _count(value: Any) -> int:
    step = int(value)
    if step < 0:
        raise ValueError(f"kv_digest_window_step must be 0 (off) or a token count, got {value!r}")
    return step


def _flag(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class Handover:
    """A prefilled request as the consumer learns it: whose blocks hold which tokens."""

    instance: str  # the producer's kvroute instance
    request_id: str  # the request's id on the producer (its ranks wait for this id)
    block_ids: tuple[tuple[int, ...], ...]  # per KV cache group, covering tokens from first_token
    first_token: int  # token held by the first block of each list
    prompt_tokens: int
    kv_digest: bool = False  # sampled: the producer's ranks store digests the consumer checks
    # vLLM's engine id of the producer that holds the blocks (its agents' names carry it); empty
    # from a producer that predates it.
    engine_id: str = ""
    # The producer's wall clock (Unix seconds) until which it holds the blocks; after it they may
    # hold another request's KV. None from a producer that predates it.
    expires_at: float | None = None

    def remaining_s(self, now: float, clock_skew_s: float) -> float:
        """Seconds of the producer's hold left at ``now`` (this engine's wall clock), less the
        clock skew allowed; infinite when the producer stated no end."""
        if self.expires_at is None:
            return float("inf")
        return self.expires_at - clock_skew_s - now

    def to_params(self) -> dict[str, Any]:
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_instance": self.instance,
            "remote_request_id": self.request_id,
            "remote_block_ids": [list(group) for group in self.block_ids],
            "remote_first_token": self.first_token,
            "prompt_tokens": self.prompt_tokens,
            **({"remote_engine_id": self.engine_id} if self.engine_id else {}),
            **({"kvroute_digest": True} if self.kv_digest else {}),
            **({"kvroute_expires_at": self.expires_at} if self.expires_at is not None else {}),
        }

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> Handover | None:
        """The handover in a consumer's request, or None when it asks for no remote prefill."""
        if not params or not params.get("do_remote_prefill"):
            return None
        try:
            groups = params["remote_block_ids"]
            if groups and not isinstance(groups[0], list):
                groups = [groups]  # one group, as NixlConnector writes it
            return cls(
                instance=str(params["remote_instance"]),
                request_id=str(params["remote_request_id"]),
                block_ids=tuple(tuple(int(b) for b in group) for group in groups),
                first_token=int(params.get("remote_first_token", 0)),
                prompt_tokens=int(params["prompt_tokens"]),
                kv_digest=bool(params.get("kvroute_digest", False)),
                engine_id=str(params.get("remote_engine_id") or ""),
                expires_at=_seconds(params.get("kvroute_expires_at")),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"kv_transfer_params lack a kvroute handover: {error}") from error


def _seconds(value: Any) -> float | None:
    return None if value is None else float(value)


def agent_name(instance: str, engine_id: str, rank: int) -> str:
    """A rank's NIXL agent: named by vLLM's engine id, new at every engine start, so a consumer
    never takes a restarted producer (same instance, same address) for its old self."""
    return f"{instance}-{engine_id}-rank{rank}" if engine_id else f"{instance}-rank{rank}"


def done_message(request_id: str, notifiers: int) -> bytes:
    """What a consumer rank tells each producer rank: ``notifiers`` ranks will say so."""
    return f"{DONE_PREFIX}:{notifiers}:{request_id}".encode()


def parse_done(message: bytes) -> tuple[str, int] | None:
    """(request id, notifiers) of a done message; None for any other notification."""
    prefix, _, rest = message.decode(errors="replace").partition(":")
    count, _, request_id = rest.partition(":")
    if prefix != DONE_PREFIX or not count.isdigit() or not request_id:
        return None
    return request_id, int(count)
