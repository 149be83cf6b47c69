"""Drives the chat page of a running `mlxcel serve` in headless Chromium over the DevTools
protocol (CDP through `--remote-debugging-pipe`: standard library only).

Run by tests/tests/server.rs (`chat_page_in_headless_chromium`): argv = chromium binary, page
URL, a JSON file of what to expect (`message`, `reply`: the greedy reply `Model::generate`
gives), and where to save a PNG screenshot. It sets temperature 0, types the message into the
prompt box, presses Enter, waits for the streamed answer and checks the reply, the live figures
and that the text arrived in several pieces. Exits non-zero with the failed check.
"""

import base64
import json
import os
import subprocess
import sys
import tempfile
import time


class Browser:
    """Chromium with CDP over a pipe pair (it reads commands on fd 3, writes on fd 4)."""

    def __init__(self, binary):
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()
        self.profile = tempfile.TemporaryDirectory(ignore_cleanup_errors=True)

        def child_fds():
            # Copied out of the way first: a pipe may already sit on fd 3 or 4.
            read, write = os.dup(to_chrome_r), os.dup(from_chrome_w)
            os.dup2(read, 3)
            os.dup2(write, 4)
            os.set_inheritable(3, True)
            os.set_inheritable(4, True)

        self.proc = subprocess.Popen(
            [
                binary,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--window-size=1000,700",
                "--remote-debugging-pipe",
                f"--user-data-dir={self.profile.name}",
                "about:blank",
            ],
            # The pipes are moved to fds 3 and 4 after the fork; closing the other fds would
            # run after that and close them again.
            preexec_fn=child_fds,
            close_fds=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self.next_id = 0
        self.buffer = b""

    def call(self, method, params=None, session=None, timeout=30):
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to_chrome, json.dumps(msg).encode() + b"\0")
        deadline = time.time() + timeout
        while time.time() < deadline:
            while b"\0" in self.buffer:
                raw, self.buffer = self.buffer.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self.next_id:
                    if "error" in reply:
                        raise SystemExit(f"FAILED: {method}: {reply['error']}")
                    return reply.get("result", {})
            chunk = os.read(self._from_chrome, 1 << 16)
            if not chunk:
                raise SystemExit("FAILED: chromium closed the pipe")
            self.buffer += chunk
        raise SystemExit(f"FAILED: {method} timed out")

    def close(self):
        try:
            os.write(self._to_chrome, json.dumps({"id": 0, "method": "Browser.close"}).encode() + b"\0")
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.profile.cleanup()


def main():
    binary, url, expect_path, shot = sys.argv[1:5]
    expect = json.load(open(expect_path))
    b = Browser(binary)
    try:
        target = b.call("Target.createTarget", {"url": url})["targetId"]
        session = b.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]

        def js(expr):
            r = b.call("Runtime.evaluate", {"expression": expr, "returnByValue": True, "awaitPromise": True}, session)
            if "exceptionDetails" in r:
                raise SystemExit(f"FAILED: {expr}: {r['exceptionDetails']}")
            return r["result"].get("value")

        def wait_for(expr, what, timeout=60):
            deadline = time.time() + timeout
            while time.time() < deadline:
                if js(expr):
                    return
                time.sleep(0.05)
            raise SystemExit(f"FAILED: waiting for {what}")

        wait_for(
            "document.readyState === 'complete' && !!document.getElementById('model')"
            " && document.getElementById('model').textContent !== '…'",
            "the page",
        )
        model = js("document.getElementById('model').textContent")
        js("document.getElementById('temperature').value = '0'; document.getElementById('max_tokens').value = '%d'" % expect["max_tokens"])
        # Record every text the assistant's message shows on the way (streamed pieces).
        js(
            """window.__texts = [];
            new MutationObserver((records) => {
              for (const r of records) {
                const msg = r.target.parentElement;
                if (!msg || !msg.classList.contains('assistant')) continue;
                for (const n of r.addedNodes) if (n.nodeType === 3) window.__texts.push(n.data);
              }
            }).observe(document.getElementById('log'), {subtree: true, childList: true});"""
        )
        # Type the message and press Enter, as a user would.
        js("document.getElementById('prompt').focus()")
        b.call("Input.insertText", {"text": expect["message"]}, session)
        for kind in ("keyDown", "keyUp"):
            b.call(
                "Input.dispatchKeyEvent",
                {"type": kind, "key": "Enter", "code": "Enter", "windowsVirtualKeyCode": 13, "text": "\r" if kind == "keyDown" else ""},
                session,
            )
        wait_for("document.getElementById('stats').textContent.includes('finish:')", "the answer")
        wait_for("/[KM]iB/.test(document.getElementById('memory').textContent)", "the memory figure", timeout=10)
        reply = js("[...document.querySelectorAll('.msg.assistant span:last-child')].map(e => e.textContent)")
        user = js("[...document.querySelectorAll('.msg.user span:last-child')].map(e => e.textContent)")
        stats = js("document.getElementById('stats').textContent")
        texts = js("window.__texts")
        png = base64.b64decode(b.call("Page.captureScreenshot", {"format": "png"}, session)["data"])
        open(shot, "wb").write(png)
        if user != [expect["message"]]:
            raise SystemExit(f"FAILED: user messages {user}")
        if reply != [expect["reply"]]:
            raise SystemExit(f"FAILED: reply {reply!r}, want {expect['reply']!r}")
        for figure in ("time to first token", "tok/s", "reused", "memory"):
            if figure not in stats:
                raise SystemExit(f"FAILED: `{figure}` missing from the figures: {stats}")
        if len(set(texts)) < 3 or not all(expect["reply"].startswith(t) for t in texts):
            raise SystemExit(f"FAILED: the reply was not streamed in growing pieces: {texts}")
        pieces = len(set(texts))
        if png[:8] != b"\x89PNG\r\n\x1a\n" or len(png) < 5000:
            raise SystemExit("FAILED: no screenshot")
        print(f"ok: {model}: reply {reply[0]!r} in {pieces} updates; {stats}; screenshot {shot} ({len(png)} bytes)")
    finally:
        b.close()


if __name__ == "__main__":
    main()
