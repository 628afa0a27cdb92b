"""``GET /playground``: a page where a person types a state and questions and sees the answers drawn.

The page is plain HTML, CSS and JavaScript shipped in the package (``slotread/serve/playground/``), with
no external assets. It calls ``/v1/systemone`` from the browser with the key the person types, which
stays in the page. ``GET /`` redirects here.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter, HTTPException
from fastapi.responses import RedirectResponse, Response

router = APIRouter(include_in_schema=False)

_ASSETS = files("slotread.serve") / "playground"
#: file name → media type of what the page loads
_MEDIA_TYPES = {
    "index.html": "text/html; charset=utf-8",
    "playground.js": "text/javascript",
    "playground.css": "text/css",
}
#: the page loads nothing from elsewhere and talks only to this server
_HEADERS = {
    "cache-control": "no-cache",  # a restarted server with a new page must not be shown the old script
    "content-security-policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
}


def _asset(name: str) -> Response:
    return Response((_ASSETS / name).read_bytes(), media_type=_MEDIA_TYPES[name], headers=_HEADERS)


@router.get("/")
async def root() -> RedirectResponse:
    return RedirectResponse("/playground")


@router.get("/playground")
async def page() -> Response:
    return _asset("index.html")


@router.get("/playground/{name}")
async def asset(name: str) -> Response:
    if name not in _MEDIA_TYPES or name == "index.html":
        raise HTTPException(404, f"no playground file {name!r}")
    return _asset(name)
