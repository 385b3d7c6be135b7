"""The web console's files: plain HTML, CSS and JavaScript shipped inside the package.

The files themselves are public (they hold no data); every call the page makes goes to the
admin-scoped API with the bearer token the operator typed in, kept in the tab's sessionStorage.
A strict Content-Security-Policy keeps the page to its own script and the API: with a token in
the page, nothing else may run or be fetched.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from aiohttp import web

from kvroute.api.keys import validated_key
from kvroute.api.problems import Problem, ProblemError

CONTENT_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' blob:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
INDEX = "index.html"


@cache
def console_files() -> dict[str, tuple[bytes, str]]:
    """File name -> (bytes, content type), read once from ``kvroute/ui``."""
    root = resources.files("kvroute").joinpath("ui")
    found = {}
    for entry in root.iterdir():
        suffix = "." + entry.name.rpartition(".")[2]
        if entry.is_file() and suffix in CONTENT_TYPES:
            found[entry.name] = (entry.read_bytes(), CONTENT_TYPES[suffix])
    return found


def _answer(name: str) -> web.Response:
    found = console_files().get(name)
    if found is None:
        raise ProblemError(
            Problem(404, "Not Found", f"the console has no file {name!r}", "not_found")
        )
    body, content_type = found
    return web.Response(
        body=body,
        content_type=content_type,
        charset="utf-8",
        headers={
            "Content-Security-Policy": CONTENT_SECURITY_POLICY,
            "X-Content-Type-Options": "nosniff",
            "Cache-Control": "no-cache",
        },
    )


async def root(request: web.Request) -> web.Response:
    raise web.HTTPFound("/ui/")


async def index(request: web.Request) -> web.Response:
    return _answer(INDEX)


async def console_file(request: web.Request) -> web.Response:
    return _answer(request[validated_key].path["asset"])
