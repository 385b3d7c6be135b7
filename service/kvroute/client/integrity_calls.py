"""The client's KV integrity calls: path outcomes (``POST``/``GET .../kv-paths``) and sampled
digests in transit (``.../kv-digests``), mixed into ``AsyncKvrouteClient``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from kvroute import wire


def _seg(value: str) -> str:
    return quote(value, safe="")


class KvIntegrityCalls:
    """Needs the client's ``_call`` (status, JSON body of a 2xx answer; raises otherwise)."""

    if TYPE_CHECKING:

        async def _call(
            self,
            method: str,
            path: str,
            *,
            body: Any = None,
            params: Mapping[str, str | int] | None = None,
            retry_sent: bool | None = None,
        ) -> tuple[int, Any]: ...

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
