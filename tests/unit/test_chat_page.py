"""The chat page as the front door serves it: its policy lets exactly its own script and style
run, and it needs nothing from another origin (the browser test: tests/integration/test_chat_page.py)."""

from __future__ import annotations

import base64
import hashlib
import re

from stoker.daemon.frontdoor.chat_page import chat_page


def policy() -> dict[str, list[str]]:
    header = dict(chat_page().headers)[b"content-security-policy"].decode()
    return {d.split()[0]: d.split()[1:] for d in header.split("; ")}


def sha256_source(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def test_only_the_pages_own_script_and_style_may_run_and_it_talks_only_to_its_origin():
    html = chat_page().body.decode()
    scripts = re.findall(r"<script>(.*?)</script>", html, re.DOTALL)
    styles = re.findall(r"<style>(.*?)</style>", html, re.DOTALL)
    assert len(scripts) == 1 and len(styles) == 1
    csp = policy()
    assert csp["default-src"] == ["'none'"]
    assert csp["script-src"] == [sha256_source(scripts[0])] and csp["style-src"] == [sha256_source(styles[0])]
    assert csp["connect-src"] == ["'self'"] and csp["frame-ancestors"] == ["'none'"]
    assert "'unsafe-inline'" not in str(csp) and "'unsafe-eval'" not in str(csp)
    # No element outside those two carries script or style (the policy would block it: a dead control).
    assert not re.search(r"<script[^>]*\bsrc=|\bon[a-z]+=\"|\bstyle=\"", html)


def test_nothing_is_loaded_from_another_origin_and_no_key_goes_in_a_url():
    html = chat_page().body.decode()
    assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/", html, re.IGNORECASE)
    assert re.findall(r"\b(?:src|href)=\"([^\"]*)\"", html) == ["data:,"]  # the empty icon only
    assert "Authorization" in html and "?key=" not in html and "api_key=" not in html


def test_the_page_is_html_not_sniffed_not_cached_stale_and_sends_no_referrer():
    headers = dict(chat_page().headers)
    assert headers[b"content-type"] == b"text/html; charset=utf-8"
    assert headers[b"x-content-type-options"] == b"nosniff"
    assert headers[b"referrer-policy"] == b"no-referrer"
    assert headers[b"cache-control"] == b"no-cache"
