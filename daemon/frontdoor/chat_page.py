"""The chat page at the front door's root (`GET /`): one static file of Stoker's own.

chat.html holds the page's HTML, its script and its style inline; nothing is fetched from
another origin. It reads the models from `GET /v1/models` (routing.py: each model's state,
backend, reason code and use, polled every 2 s) and chats through `POST /v1/chat/completions`,
streamed, sending the user key it keeps in the browser's localStorage as a header (never in a
URL). The page itself carries no secret, so it is served without a key; every call it makes is
checked like any client's. Why a page of Stoker's own and not llama-server's web UI:
docs/chat-page.md.

It is served with a Content-Security-Policy that lets it run only its own inline script and
style (by their sha256, computed here from the file) and talk only to its own origin.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib.resources
import re

import attrs

PAGE_FILE = "chat.html"


@attrs.frozen
class Page:
    """The page's bytes and the headers it is served with."""

    body: bytes
    headers: tuple[tuple[bytes, bytes], ...]


def inline_hashes(html: str, tag: str) -> list[str]:
    """CSP sources for each inline `<tag>` element's text, by its sha256."""
    texts = re.findall(rf"<{tag}>(.*?)</{tag}>", html, re.S)
    return ["'sha256-" + base64.b64encode(hashlib.sha256(t.encode()).digest()).decode() + "'" for t in texts]


def content_security_policy(html: str) -> str:
    """Only the page's own script and style run; it connects only to its own origin, loads no
    image but a data: URL, cannot be framed, and has no base URL or form target to hijack."""
    return "; ".join(
        [
            "default-src 'none'",
            "script-src " + " ".join(inline_hashes(html, "script")),
            "style-src " + " ".join(inline_hashes(html, "style")),
            "connect-src 'self'",
            "img-src data:",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        ]
    )


@functools.cache
def chat_page() -> Page:
    """The page as served: read from the package once, its policy computed from its text."""
    html = importlib.resources.files(__package__).joinpath(PAGE_FILE).read_text("utf-8")
    headers = {
        "content-type": "text/html; charset=utf-8",
        "content-security-policy": content_security_policy(html),
        "x-content-type-options": "nosniff",
        "referrer-policy": "no-referrer",
        "cross-origin-opener-policy": "same-origin",
        "cache-control": "no-cache",
    }
    return Page(html.encode(), tuple((k.encode(), v.encode()) for k, v in headers.items()))
