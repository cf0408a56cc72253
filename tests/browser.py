"""Headless chromium driven through chromedriver's W3C WebDriver HTTP API (no selenium needed), for the page tests.

:func:`find_browser` skips without chromium and chromedriver, and fails instead where ``ARPO_REQUIRE_BROWSER=1``
(CI, where scripts/test installs them), so the browser tests never skip silently there.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from typing import Any

import pytest

from arpo_base.http import request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_browser() -> tuple[str, str]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    chromedriver = shutil.which("chromedriver")
    if chromium is None or chromedriver is None:
        if os.environ.get("ARPO_REQUIRE_BROWSER") == "1":
            pytest.fail("ARPO_REQUIRE_BROWSER=1 (CI) but chromium/chromedriver are missing: scripts/test installs them")
        pytest.skip("no chromium/chromedriver here (Debian: apt-get install chromium chromium-driver)")
    return chromium, chromedriver


class WebDriver:
    """Just enough of the WebDriver protocol: open a URL, run a script, take a screenshot."""

    def __init__(self, chromedriver: str, chromium: str, profile: str, size: str = "1300,850") -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [chromedriver, f"--port={self.port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                self.call("GET", "/status")
                break
            except Exception:
                if time.monotonic() > deadline:
                    self.proc.terminate()
                    raise
                time.sleep(0.2)
        caps = {
            "capabilities": {
                "alwaysMatch": {
                    "goog:chromeOptions": {
                        "binary": chromium,
                        "args": [
                            "--headless",
                            "--no-sandbox",
                            "--disable-gpu",
                            "--disable-dev-shm-usage",
                            f"--window-size={size}",
                            f"--user-data-dir={profile}",
                        ],
                    }
                }
            }
        }
        self.session = self.call("POST", "/session", caps)["sessionId"]

    def call(self, method: str, path: str, body: dict | None = None) -> Any:
        return request(method, f"http://127.0.0.1:{self.port}{path}", body, timeout=120).data["value"]

    def do(self, method: str, path: str, body: dict | None = None) -> Any:
        return self.call(method, f"/session/{self.session}{path}", body)

    def open(self, url: str) -> None:
        self.do("POST", "/url", {"url": url})

    def js(self, script: str) -> Any:
        return self.do("POST", "/execute/sync", {"script": script, "args": []})

    def screenshot(self) -> bytes:
        """The viewport as PNG bytes."""
        import base64

        return base64.b64decode(self.do("GET", "/screenshot"))

    def wait(self, script: str, timeout_s: float = 30, what: str = "") -> Any:
        """Poll ``script`` (a JS expression body returning a value) until it is truthy; return that value."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.js(script)
            if value:
                return value
            assert time.monotonic() < deadline, what or f"timed out waiting for: {script}"
            time.sleep(0.2)

    def close(self) -> None:
        try:
            self.call("DELETE", f"/session/{self.session}")
        finally:
            self.proc.terminate()
            self.proc.wait(10)
