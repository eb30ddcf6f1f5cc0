"""Evaluate JavaScript in a page loaded by headless Chromium over the DevTools protocol (--remote-debugging-pipe:
no network, no extra package): what a person's browser lays out, measured."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path


def chromium() -> str | None:
    """The installed Chromium, or None."""
    return next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


def evaluate(browser: str, page: Path, expression: str, tmp_path: Path, size: tuple[int, int] = (1280, 800)
             ) -> object:
    """Load ``page`` in headless Chromium with a window of ``size`` (CSS pixels) and evaluate ``expression``
    there; its value is a JSON string, returned parsed."""
    width, height = size
    to_chrome_r, to_chrome_w = os.pipe()
    from_chrome_r, from_chrome_w = os.pipe()
    env = dict(os.environ, HOME=str(tmp_path), XDG_CONFIG_HOME=str(tmp_path / "cfg"),
               XDG_CACHE_HOME=str(tmp_path / "cache"))
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--no-first-run", "--disable-extensions", "--hide-scrollbars", f"--window-size={width},{height}",
           f"--user-data-dir={tmp_path / 'profile'}", "--remote-debugging-pipe", "about:blank"]

    def child_fds() -> None:   # the protocol's pipes are the browser's fds 3 (in) and 4 (out)
        src_in, src_out = os.dup(to_chrome_r), os.dup(from_chrome_w)   # above 4: dup2 cannot clobber them
        os.dup2(src_in, 3)
        os.dup2(src_out, 4)

    # close_fds would close 3 and 4 after child_fds; the browser inherits the test's other fds and is killed below
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env, start_new_session=True, close_fds=False, preexec_fn=child_fds)
    os.close(to_chrome_r)
    os.close(from_chrome_w)
    buf = b""
    ids = iter(range(1, 1000))

    def call(method: str, params: dict[str, object], session: str | None = None) -> dict[str, object]:
        nonlocal buf
        msg_id = next(ids)
        msg: dict[str, object] = {"id": msg_id, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        os.write(to_chrome_w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                answer = json.loads(raw)
                if answer.get("id") == msg_id:
                    assert "error" not in answer, answer
                    result = answer["result"]
                    assert isinstance(result, dict)
                    return result
            chunk = os.read(from_chrome_r, 1 << 16)
            assert chunk, "the browser closed its protocol pipe"
            buf += chunk
        raise AssertionError(f"no answer to {method}")

    try:
        target = call("Target.createTarget", {"url": page.resolve().as_uri()})
        session = call("Target.attachToTarget", {"targetId": target["targetId"], "flatten": True})["sessionId"]
        assert isinstance(session, str)
        call("Emulation.setDeviceMetricsOverride",
             {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}, session)
        want = f"{page.resolve().as_uri()}|complete"   # the page itself loaded, not the blank one before it
        for _ in range(200):
            state = call("Runtime.evaluate", {"expression": "location.href + '|' + document.readyState",
                                              "returnByValue": True}, session)
            if state["result"] == {"type": "string", "value": want}:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"the page did not load: {state}")
        got = call("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session)
        value = got["result"]
        assert isinstance(value, dict)
        return json.loads(str(value["value"]))
    finally:
        os.close(to_chrome_w)
        os.close(from_chrome_r)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
