"""Headless Chromium, driven over its DevTools protocol (aiohttp's WebSocket client): a page opened as a person
sees it at a given width, and what on it would be cut off or missing."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import aiohttp

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

# A page's problems as a person would see them, as lines: the page wider than the window (a sideways scrollbar for
# the whole page), a block whose content is cut (overflow hidden) or spills out of it by more than a margin without
# a scrollbar of its own or of a block around it, a table whose column starts out of sight in the block that scrolls
# it (a reader sees no sign of it), and an image that did not load.
PROBLEMS_JS = """
async (rootSelector) => {
  await document.fonts.ready;
  await Promise.all([...document.images].map((img) => img.decode().catch(() => null)));
  const root = document.querySelector(rootSelector) || document.body, problems = [];
  const view = document.documentElement.clientWidth;
  const scrolls = (el) => ["auto", "scroll"].includes(getComputedStyle(el).overflowX);
  const name = (el) => el.tagName.toLowerCase() + (typeof el.className === "string" && el.className.trim()
    ? "." + el.className.trim().split(/\\s+/).join(".") : "");
  const text = (el) => (el.textContent || "").trim().replace(/\\s+/g, " ").slice(0, 70);
  if (document.documentElement.scrollWidth > view + 1)
    problems.push(`the page is ${document.documentElement.scrollWidth}px wide in a ${view}px window`);
  for (const el of root.querySelectorAll("*")) {
    const style = getComputedStyle(el);
    if (style.display === "none" || style.visibility === "hidden" || ["absolute", "fixed"].includes(style.position))
      continue;
    let reachable = false;  // inside a block that scrolls sideways
    for (let up = el.parentElement; up && up !== root.parentElement && !reachable; up = up.parentElement)
      reachable = scrolls(up);
    if (reachable || scrolls(el)) continue;
    const wider = el.scrollWidth - el.clientWidth;
    if (["hidden", "clip"].includes(style.overflowX) && wider > 1)
      problems.push(`${name(el)} "${text(el)}": ${wider}px of its content cut off`);
    else if (style.overflowX === "visible" && el.clientWidth > 0 && wider > 16)
      problems.push(`${name(el)} "${text(el)}": its content spills ${wider}px out of it, with no scrollbar`);
    else if (el.getBoundingClientRect().right > view + 1)
      problems.push(`${name(el)} "${text(el)}": past the window's right edge`);
  }
  for (const cell of root.querySelectorAll("tr:first-child > th, tr:first-child > td")) {
    let seen = view;  // the right edge of what the blocks that scroll the table sideways show of it
    for (let up = cell.parentElement; up && up !== root.parentElement; up = up.parentElement)
      if (scrolls(up)) seen = Math.min(seen, up.getBoundingClientRect().right);
    if (cell.getBoundingClientRect().left > seen)
      problems.push(`the table column "${text(cell)}" starts out of sight: it is reached only by scrolling sideways`);
  }
  for (const img of document.images)
    if (!img.complete || img.naturalWidth === 0)
      problems.push(`the image ${(img.getAttribute("src") || "").slice(0, 80)} did not load`);
  return problems;
}
"""


class Browser:
    """One headless Chromium for many pages, each opened in a fresh tab at ``width`` x ``height`` CSS pixels."""

    def __init__(self, width: int = 1280, height: int = 900):
        self.width, self.height = width, height
        self._ids = itertools.count(1)
        self._events: list[dict] = []  # messages read while waiting for another: events, kept for _event

    async def __aenter__(self) -> Browser:
        self._profile = tempfile.TemporaryDirectory(ignore_cleanup_errors=True)
        self._process = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--remote-debugging-port=0",
             f"--user-data-dir={self._profile.name}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        address = await asyncio.to_thread(self._devtools_address)
        self._session = aiohttp.ClientSession()
        self._socket = await self._session.ws_connect(address, max_msg_size=0)
        return self

    def _devtools_address(self) -> str:
        for line in self._process.stderr:
            if line.startswith("DevTools listening on "):
                return line.split(" on ", 1)[1].strip()
        raise RuntimeError(f"chromium exited {self._process.wait()} before it listened")

    async def __aexit__(self, *exc) -> None:
        await self._socket.close()
        await self._session.close()
        os.killpg(self._process.pid, signal.SIGTERM)  # the browser and the helpers it started
        await asyncio.to_thread(self._process.wait)
        self._profile.cleanup()

    async def _call(self, method: str, session: str | None = None, **params) -> dict:
        number = next(self._ids)
        await self._socket.send_json({"id": number, "method": method, "params": params,
                                      **({"sessionId": session} if session else {})})  # fmt: skip
        while True:
            message = json.loads((await self._socket.receive(timeout=60)).data)
            if message.get("id") == number:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]
            self._events.append(message)

    async def _event(self, method: str, session: str) -> dict:
        while True:
            for message in self._events:
                if message.get("method") == method and message.get("sessionId") == session:
                    self._events.remove(message)
                    return message
            self._events.append(json.loads((await self._socket.receive(timeout=60)).data))

    async def problems(self, url: str, root: str = "body", screenshot: Path | None = None) -> list[str]:
        """What a person would find cut off or missing on ``url``, within the element ``root`` selects; the page
        as seen written to ``screenshot`` (PNG), where given."""
        target = (await self._call("Target.createTarget", url="about:blank"))["targetId"]
        session = (await self._call("Target.attachToTarget", targetId=target, flatten=True))["sessionId"]
        try:
            await self._call("Emulation.setDeviceMetricsOverride", session, width=self.width, height=self.height,
                             deviceScaleFactor=1, mobile=False)  # fmt: skip
            await self._call("Page.enable", session)
            await self._call("Page.navigate", session, url=url)
            await self._event("Page.loadEventFired", session)
            found = await self._call("Runtime.evaluate", session, expression=f"({PROBLEMS_JS})({json.dumps(root)})",
                                     awaitPromise=True, returnByValue=True)  # fmt: skip
            if "exceptionDetails" in found:
                raise RuntimeError(f"{url}: {found['exceptionDetails']}")
            if screenshot is not None:
                shot = await self._call("Page.captureScreenshot", session, captureBeyondViewport=True)
                screenshot.write_bytes(base64.b64decode(shot["data"]))
            return found["result"]["value"]
        finally:
            await self._call("Target.closeTarget", targetId=target)

    async def evaluate(self, url: str, expression: str):
        """The value of the JavaScript ``expression`` (a promise awaited) run in a page opened at ``url``: what
        a page's own script there would get."""
        target = (await self._call("Target.createTarget", url="about:blank"))["targetId"]
        session = (await self._call("Target.attachToTarget", targetId=target, flatten=True))["sessionId"]
        try:
            await self._call("Page.enable", session)
            await self._call("Page.navigate", session, url=url)
            await self._event("Page.loadEventFired", session)
            found = await self._call("Runtime.evaluate", session, expression=expression, awaitPromise=True,
                                     returnByValue=True)  # fmt: skip
            if "exceptionDetails" in found:
                raise RuntimeError(f"{url}: {found['exceptionDetails']}")
            return found["result"].get("value")
        finally:
            await self._call("Target.closeTarget", targetId=target)


def assert_shows_whole(url: str, root: str = "body", name: str = "") -> None:
    """Fail with what a person would find cut off or missing on ``url`` (skipped without Chromium)."""
    assert_all_show_whole({name or "page": url}, root)


def assert_all_show_whole(pages: dict[str, str], root: str = "body") -> None:
    """The same for every page (by name: its URL), in one browser, failing with every page's problems at once.
    With MHASERVE_TEST_SCREENSHOTS=DIR each page as seen is kept there as NAME.png, for a person to look at."""
    import pytest

    if CHROMIUM is None:
        pytest.skip("needs Chromium (bash tests/tools/install_chromium.sh)")
    shots = os.environ.get("MHASERVE_TEST_SCREENSHOTS")

    async def look() -> dict[str, list[str]]:
        async with Browser() as browser:
            return {url: await browser.problems(url, root, Path(shots) / f"{name}.png" if shots else None)
                    for name, url in pages.items()}  # fmt: skip

    found = {url: problems for url, problems in asyncio.run(look()).items() if problems}
    assert not found, "\n".join(f"{url}:\n  " + "\n  ".join(problems) for url, problems in found.items())
