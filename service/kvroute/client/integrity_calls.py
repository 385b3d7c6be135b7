"""The client's KV integrity calls: path outcomes (``POST``/``GET .../kv-paths``) and sampled
digests in transit (``.../kv-digests``); ``AsyncKvrouteClient`` builds on them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvroute import wire
from kvroute.client.http import ServiceCalls
from kvroute.client.http import segment as _seg


class KvIntegrityCalls(ServiceCalls):
    """The integrity calls, over the client's one session and ``_call``."""

    async def report_kv_path(self, deployment: str, report: Mapping[str, Any]) -> wire.KvPath:
        """Reports one path's canary or digest outcome (``integrity.path_report`` builds it).
        Resent on a lost connection: a report names the path's latest outcome, so a repeat
        stores the same."""
        path = f"/v1/deployments/{_seg(deployment)}/kv-paths"
        _, body = await self._call("POST", path, body=dict(report), retry_sent=True)
        return wire.from_json(wire.KvPath, body)

    async def kv_paths(self, deployment: str) -> wire.KvPaths:
        """Every reported path's outcome, judged against the live registrations."""
        _, body = await self._call("GET", f"/v1/deployments/{_seg(deployment)}/kv-paths")
        return wire.from_json(wire.KvPaths, body)

    async def put_kv_digest(
        self, deployment: str, producer: str, request_id: str, rank: int, digest: Mapping[str, Any]
    ) -> None:
        """Stores a producer rank's digest of a sampled request (``KvDigest.to_json()``)."""
        body = {"producer": producer, "request_id": request_id, "rank": rank, "digest": digest}
        path = f"/v1/deployments/{_seg(deployment)}/kv-digests"
        await self._call("POST", path, body=body, retry_sent=True)

    async def kv_digests(
        self, deployment: str, producer: str, request_id: str
    ) -> dict[int, dict[str, Any]]:
        """Producer rank -> its digest of the request, for the ranks that stored one yet."""
        params = {"producer": producer, "request_id": request_id}
        path = f"/v1/deployments/{_seg(deployment)}/kv-digests"
        _, body = await self._call("GET", path, params=params)
        return {int(item["rank"]): dict(item["digest"]) for item in body["ranks"]}
