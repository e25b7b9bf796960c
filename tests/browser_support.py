"""Headless Chromium driven through the DevTools protocol, with the standard library only (a minimal
WebSocket client): open a page, wait for a condition in it, run JavaScript, take screenshots.

    with Browser() as b:
        b.open("http://127.0.0.1:5000/#/experiments/1")
        b.wait_for("document.body.innerText.includes('train-')", timeout=30)
        text = b.eval("document.body.innerText")
        b.screenshot("page.png")
"""
from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

CHROMIUM = os.environ.get("MEMOPD_CHROMIUM", "/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1920,1080", "--remote-debugging-port=0"]


class _WebSocket:
    """Text frames over a plain socket (RFC 6455 client side: masked frames out, unmasked in)."""

    def __init__(self, url: str, timeout: float = 60):
        u = urlparse(url)
        self.sock = socket.create_connection((u.hostname, u.port), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET {u.path} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(1)
            if not chunk:
                raise ConnectionError("DevTools closed the connection during the handshake")
            head += chunk
        if b" 101 " not in head.split(b"\r\n")[0]:
            raise ConnectionError(f"DevTools refused the WebSocket: {head[:200]!r}")

    def _exact(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("DevTools closed the connection")
            buf += chunk
        return buf

    def send(self, text: str) -> None:
        data, mask = text.encode(), os.urandom(4)
        n = len(data)
        head = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else
                                bytes([0x80 | 126]) + struct.pack(">H", n) if n < 1 << 16 else
                                bytes([0x80 | 127]) + struct.pack(">Q", n))
        self.sock.sendall(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))

    def recv(self) -> str:
        parts = []
        while True:
            b0, b1 = self._exact(2)
            n = b1 & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._exact(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._exact(8))[0]
            payload = self._exact(n)
            opcode = b0 & 0x0F
            if opcode == 0x8:
                raise ConnectionError("DevTools closed the WebSocket")
            if opcode in (0x9, 0xA):  # ping / pong: not sent by DevTools in practice
                continue
            parts.append(payload)
            if b0 & 0x80:  # FIN
                return b"".join(parts).decode()

    def close(self) -> None:
        self.sock.close()


class Browser:
    """A fresh headless Chromium (its own temporary profile) and its first page."""

    def __init__(self, chromium: str = CHROMIUM, timeout: float = 60):
        self.chromium, self.timeout = chromium, timeout
        self._id = 0

    def __enter__(self):
        self.profile = tempfile.mkdtemp(prefix="memopd_chromium_")
        self.log = open(Path(self.profile) / "stderr.txt", "w+")
        self.proc = subprocess.Popen([self.chromium, *FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=self.log,
                                     start_new_session=True)  # its own process group: its helpers end with it
        port_file = Path(self.profile) / "DevToolsActivePort"
        deadline = time.time() + self.timeout
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.proc.poll() is not None or time.time() > deadline:
                self.log.seek(0)
                err = self.log.read()[-2000:]
                self.__exit__()
                raise RuntimeError(f"chromium did not start: {err}")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        pages = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10))
        page = next(p for p in pages if p["type"] == "page")
        self.ws = _WebSocket(page["webSocketDebuggerUrl"], self.timeout)
        self.call("Page.enable")
        self.call("Runtime.enable")
        self.console: list[str] = []
        return self

    def __exit__(self, *exc):
        try:
            if hasattr(self, "ws"):
                self.ws.close()
        finally:
            for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)
                    self.proc.wait(wait)
                    break
                except ProcessLookupError:
                    break
                except subprocess.TimeoutExpired:
                    continue
            self.log.close()
            shutil.rmtree(self.profile, ignore_errors=True)

    def call(self, method: str, **params):
        self._id += 1
        my = self._id
        self.ws.send(json.dumps({"id": my, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("method") == "Runtime.exceptionThrown":
                self.console.append(msg["params"]["exceptionDetails"].get("text", "") + " " + json.dumps(
                    msg["params"]["exceptionDetails"].get("exception", {}).get("description", ""))[:500])
            if msg.get("id") == my:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def eval(self, js: str):
        """The value of a JavaScript expression in the page (promises awaited)."""
        r = self.call("Runtime.evaluate", expression=js, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{js[:80]}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, js: str, timeout: float = 30, interval: float = 0.25):
        """Poll until the expression is truthy; its value. TimeoutError with the page's text if not."""
        deadline = time.time() + timeout
        while True:
            try:
                v = self.eval(js)
            except RuntimeError:
                v = None
            if v:
                return v
            if time.time() > deadline:
                text = re.sub(r"\s+", " ", self.eval("document.body ? document.body.innerText : ''") or "")
                raise TimeoutError(f"waited {timeout} s for {js!r}; the page says: {text[:1500]}")
            time.sleep(interval)

    def click_text(self, text: str, selector: str = "a, button, [role=button], [role=tab], [role=menuitem], "
                   "[role=menuitemcheckbox], [role=option], span, div, td", real: bool = True) -> bool:
        """Click the innermost visible element matching `selector` whose text is exactly `text`."""
        return self.click(f"""[...document.querySelectorAll({json.dumps(selector)})].filter(e => e.offsetParent !== null
            && e.innerText && e.innerText.trim() === {json.dumps(text)})""", real)

    def click_text_until(self, text: str, js: str, tries: int = 4, wait: float = 5) -> object:
        """Click `text` until `js` is truthy (its value): a click that lands while a closing menu's overlay
        still covers the page is lost, so it is repeated (up to `tries` times, `wait` s each)."""
        for attempt in range(tries):
            assert self.click_text(text), f"no visible element reads {text!r}"
            try:
                return self.wait_for(js, timeout=wait)
            except TimeoutError:
                if attempt == tries - 1:
                    raise

    def click(self, js_elements: str, real: bool = True) -> bool:
        """Click the innermost element of a JavaScript expression that gives a list of elements: with real
        mouse events at its centre (menus that open on pointer-down need them), or el.click() (`real`
        False: for pages that re-render the element between mouse-down and mouse-up)."""
        box = self.eval(f"""(() => {{
            const els = {js_elements};
            const el = els.find(e => ![...e.querySelectorAll('*')].some(c => els.includes(c))) || els[0];
            if (!el) return null;
            el.scrollIntoView({{block: 'center'}});
            if (!{json.dumps(real)}) {{ el.click(); return true; }}
            const r = el.getBoundingClientRect();
            return [r.x + r.width / 2, r.y + r.height / 2]; }})()""")
        if box is True or not box:
            return bool(box)
        x, y = box
        self.call("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)
        return True

    def key(self, key: str, code: int) -> None:
        """Press and release a key (e.g. "Escape", 27)."""
        for kind in ("keyDown", "keyUp"):
            self.call("Input.dispatchKeyEvent", type=kind, key=key, code=key, windowsVirtualKeyCode=code)

    def type_text(self, text: str) -> None:
        """Type into the focused element."""
        self.call("Input.insertText", text=text)

    def screenshot(self, path: str | Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(base64.b64decode(data))
