"""``reprules audit --html``: the page, opened in a real headless Chromium.

The browser is driven over the Chrome DevTools Protocol on a pipe
(``--remote-debugging-pipe``), with the standard library only, so the test
runs wherever a Chromium or Chrome binary is found (``.ci/run`` installs
Debian's ``chromium``) and skips, saying so, where none is. It reads the
rendered chart (bar sizes in proportion to the bytes, off vs on; labels
readable and inside the chart), the rendered tables (kernel names, how each is
covered, one row per collective), checks that viewing the page makes no
request beyond the file itself, and takes a screenshot.
``REPRULES_UPDATE_SCREENSHOT=1`` also writes it to ``examples/audit_report.png``
(the README's picture).
"""

import base64
import contextlib
import fcntl
import io
import json
import os
import pathlib
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from reprules._audit import _cli, _html

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
SCREENSHOT = pathlib.Path(__file__).parent.parent / "examples" / "audit_report.png"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--disable-extensions", "--mute-audio", "--hide-scrollbars")


def find_browser():
    """The Chromium/Chrome binary: $REPRULES_CHROMIUM, /usr/bin/chromium, else one on PATH."""
    candidates = [os.environ.get("REPRULES_CHROMIUM"), "/usr/bin/chromium", *map(shutil.which, BROWSERS)]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def _high(fd):
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return moved


class Browser:
    """A headless Chromium driven over the DevTools protocol on fds 3 (commands) and 4 (replies)."""

    def __init__(self, binary, profile):
        to_child, self._send = os.pipe()
        self._recv, from_child = os.pipe()
        # The protocol pipe must be fds 3 and 4 in the browser: bash moves them there, from
        # fds above 9 so that moving one cannot overwrite the other.
        to_child, from_child = (_high(fd) for fd in (to_child, from_child))
        self.proc = subprocess.Popen(
            ["bash", "-c", f'exec "$0" "$@" 3<&{to_child} 4>&{from_child}', binary, *FLAGS,
             f"--user-data-dir={profile}", "--remote-debugging-pipe", "about:blank"],
            pass_fds=(to_child, from_child), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        os.close(to_child)
        os.close(from_child)
        self._buffer, self._next_id, self.events = b"", 0, []
        self.session = None

    def call(self, method, session=True, timeout=60, **params):
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session and self.session is not None:
            message["sessionId"] = self.session
        os.write(self._send, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read(timeout)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method, timeout=60):
        for i, event in enumerate(self.events):
            if event.get("method") == method:
                return self.events.pop(i)
        while True:
            event = self._read(timeout)
            if event.get("method") == method:
                return event
            self.events.append(event)

    def _read(self, timeout):
        deadline = time.monotonic() + timeout
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._recv], [], [], left)[0]:
                raise TimeoutError("no reply from the browser")
            chunk = os.read(self._recv, 1 << 20)
            if not chunk:
                raise RuntimeError("the browser closed the protocol pipe")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def open(self, url, width=1280, height=900):
        target = self.call("Target.createTarget", session=False, url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", session=False, targetId=target,
                                 flatten=True)["sessionId"]
        self.call("Network.enable")
        self.call("Page.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                  mobile=False)
        self.events.clear()
        self.call("Page.navigate", url=url)
        self.wait_for("Page.loadEventFired")

    def evaluate(self, expression):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(result["exceptionDetails"])
        return result["result"]["value"]

    def requests(self):
        return [e["params"]["request"]["url"] for e in self.events if e.get("method") == "Network.requestWillBeSent"]

    def screenshot(self, path, height):
        self.call("Emulation.setDeviceMetricsOverride", width=1280, height=height, deviceScaleFactor=1,
                  mobile=False)
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self):
        try:
            self.call("Browser.close", session=False, timeout=10)
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._send)
        os.close(self._recv)


MEASURE = r"""
(() => {
  const box = e => { const b = e.getBoundingClientRect(); return {x: b.x, y: b.y, w: b.width, h: b.height}; };
  const text = e => e.innerText.replace(/\s+/g, ' ').trim();
  return {
    scripts: document.scripts.length,
    resources: performance.getEntriesByType('resource').map(r => r.name),
    h1: text(document.querySelector('h1')),
    workloads: [...document.querySelectorAll('section.workload[data-name]')].map(s => ({
      name: s.dataset.name,
      svg: box(s.querySelector('.chart svg')),
      bars: [...s.querySelectorAll('rect.bar')].map(r => ({
        variant: r.dataset.variant, status: r.classList.contains('defensive') ? 'defensive' : 'needed',
        bytes: +r.dataset.bytes, fill: getComputedStyle(r).fill, ...box(r)})),
      texts: [...s.querySelectorAll('.chart svg text')].map(t => ({
        cls: t.getAttribute('class'), text: t.textContent, fill: getComputedStyle(t).fill, ...box(t)})),
      kernels: [...s.querySelectorAll('table.kernels')].map(t => [...t.querySelectorAll('tr.kernel')].map(
        r => [...r.cells].map(text))),
      collectives: [...s.querySelectorAll('table.collectives')].map(t => [...t.querySelectorAll('tr.collective')]
        .map(r => [...r.cells].map(text))),
      headings: [...s.querySelectorAll('h3')].map(text),
    })),
  };
})()
"""


@pytest.fixture(scope="module")
def audited(tmp_path_factory):
    """The default audit, as JSON and as the HTML page (one run for the module)."""
    page = tmp_path_factory.mktemp("audit_html") / "audit.html"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert _cli.main(["audit", "--json", "--quiet", "--html", str(page)]) == 0
    return json.loads(out.getvalue()), page


def test_the_page_is_self_contained(audited):
    doc, page = audited
    text = page.read_text()
    assert text == _html.render(doc)  # the page is the JSON document, rendered
    assert len(text) < 200_000
    for needle in ("<script", "<link", "<img", "<iframe", "@import", "url(", "src=", "http:", "https:"):
        assert needle not in text.lower(), needle
    assert "<svg" in text and "<style>" in text


@pytest.fixture(scope="module")
def browser():
    binary = find_browser()
    if binary is None:
        pytest.skip("no Chromium or Chrome found (looked at $REPRULES_CHROMIUM, /usr/bin/chromium and "
                    f"{', '.join(BROWSERS)} on PATH); .ci/run installs Debian's `chromium` "
                    "(apt-get install -y chromium)")
    profile = tempfile.mkdtemp(prefix="reprules-chromium-")
    b = Browser(binary, profile)
    try:
        b.call("Browser.getVersion", session=False, timeout=60)
    except Exception as err:
        b.close()
        shutil.rmtree(profile, ignore_errors=True)
        pytest.fail(f"{binary} did not answer the DevTools protocol on --remote-debugging-pipe: {err}")
    yield b
    b.close()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def rendered(audited, browser):
    doc, page = audited
    url = page.resolve().as_uri()
    browser.open(url)
    return doc, page, url, browser.evaluate(MEASURE), browser.requests()


def test_no_network_when_viewed(rendered):
    _, _, url, seen, requests = rendered
    assert requests == [url]  # the file itself, nothing else
    assert seen["resources"] == [] and seen["scripts"] == 0


def test_chart_bars_are_in_proportion(rendered):
    doc, _, _, seen, _ = rendered
    by_name = {w["name"]: w for w in seen["workloads"]}
    assert list(by_name) == [w["name"] for w in doc["workloads"]] == ["issue21855", "tp_mlp", "layer_norm"]
    for w in doc["workloads"]:
        got = by_name[w["name"]]
        bars = got["bars"]
        assert bars, w["name"]
        for bar in bars:  # each drawn bar has a real size, and lies inside the chart
            assert bar["w"] > 0.5 and 10 <= bar["h"] <= 40, bar
            assert got["svg"]["x"] - 0.5 <= bar["x"] and bar["x"] + bar["w"] <= got["svg"]["x"] + got["svg"]["w"] + 0.5
        # Every bar of a workload has one scale: pixels per byte.
        scale = {round(b["w"] / b["bytes"], 6) for b in bars}
        assert max(scale) - min(scale) <= 0.01 * max(scale), scale
        for key in ("off", "on"):
            drawn = {s: sum(b["w"] for b in bars if b["variant"] == key and b["status"] == s)
                     for s in ("defensive", "needed")}
            defensive, total = w[key]["defensive_sent_bytes"], w[key]["sent_bytes"]  # bytes each device sends
            assert (drawn["defensive"] > 0) == (defensive > 0) and (drawn["needed"] > 0) == (total > defensive)
            peak = max(w["off"]["sent_bytes"], w["on"]["sent_bytes"])
            full = max(b["w"] + b["x"] for b in bars) - min(b["x"] for b in bars)
            assert abs(sum(drawn.values()) - full * total / peak) <= 1.0, (w["name"], key, drawn)
        colors = {b["status"]: b["fill"] for b in bars}
        assert len(set(colors.values())) == len(colors)  # defensive and needed look different
    # Off vs on, as the bytes say: issue21855 loses its whole (defensive) bar, tp_mlp a sliver.
    issue, mlp, ln = (by_name[n]["bars"] for n in ("issue21855", "tp_mlp", "layer_norm"))
    assert [(b["variant"], b["status"]) for b in issue] == [("off", "defensive")]
    off = sum(b["w"] for b in mlp if b["variant"] == "off")
    on = sum(b["w"] for b in mlp if b["variant"] == "on")
    assert on / off == pytest.approx(13312 / 13824, abs=0.01)  # the audit's text report, by hand: test_cli.py
    assert sum(b["w"] for b in ln if b["variant"] == "on") / sum(b["w"] for b in ln if b["variant"] == "off") \
        == pytest.approx(1536 / 5888, abs=0.01)


def test_chart_labels_are_readable(rendered):
    _, _, _, seen, _ = rendered
    for w in seen["workloads"]:
        texts = w["texts"]
        assert [t["text"] for t in texts if t["cls"] == "label"] == ["checking off", "reprules (checking on)"]
        values = [t["text"] for t in texts if t["cls"] == "value"]
        assert all(re.fullmatch(r"[\d,]+ B( \([\d,]+ B defensive\))?|no collectives", v) for v in values), values
        svg = w["svg"]
        for t in texts:
            assert t["h"] >= 12, t  # about 13 px text at 1280 px wide
            assert svg["x"] <= t["x"] and t["x"] + t["w"] <= svg["x"] + svg["w"] + 0.5, t  # not clipped
            assert t["fill"] not in ("none", "rgb(255, 255, 255)"), t
        for t in texts:  # a label does not run into its bar, nor the bar into its value
            row = [b for b in w["bars"] if abs((b["y"] + b["h"] / 2) - (t["y"] + t["h"] / 2)) < 8]
            for b in row:
                assert t["x"] + t["w"] <= b["x"] + 0.5 or b["x"] + b["w"] <= t["x"] + 0.5, (t, b)
    mlp = next(w for w in seen["workloads"] if w["name"] == "tp_mlp")
    assert [t["text"] for t in mlp["texts"] if t["cls"] == "value"] == ["13,824 B (512 B defensive)", "13,312 B"]


def test_tables_show_kernels_coverage_and_collectives(rendered):
    doc, _, _, seen, _ = rendered
    by_name = {w["name"]: w for w in seen["workloads"]}
    for w in doc["workloads"]:
        got = by_name[w["name"]]
        assert got["headings"][:2] == ["Kernels, checking off", "Collectives, checking off"]
        kernel_tables = iter(got["kernels"])
        collective_tables = iter(got["collectives"])
        for key in ("off", "on"):
            v = w[key]
            rows = next(kernel_tables)
            assert [r[0] for r in rows] == [k["name"] for k in v["kernels"]]
            for row, k in zip(rows, v["kernels"]):
                assert row[4] == k["covered_by"] == ("identity" if key == "on" else "none")
                assert row[3] == (k["rule"] if k["has_rule"] else "no rule")
                if key == "off":  # no rule: what inference would do
                    inference = k["inference"]
                    if inference["covers"]:
                        assert row[6] == f"would cover it: {inference['rule']}", row
                    else:
                        assert row[6].startswith(f"refuses: {inference['primitive']}"), row
                        assert row[6].endswith(inference["reason"]), row
                else:
                    assert row[6] == ""
            if v["collectives"]:
                rows = next(collective_tables)
                assert len(rows) == len(v["collectives"]) == v["count"]
                for row, c in zip(rows, v["collectives"]):
                    assert row[1] == c["kind"] and row[2] == ",".join(c["axes"])
                    assert row[4] == f"{c['bytes']:,}" and row[5] == f"{c['sent_bytes']:,}"
                    assert row[6].startswith(c["status"])
                    assert row[10].startswith(c["op_name"])
    issue = by_name["issue21855"]["collectives"][0]
    assert issue[0][6].startswith("defensive operand replicated over model likely cause: no rule for copy_kernel")


def test_screenshot(rendered, browser, tmp_path):
    _, _, _, seen, _ = rendered
    shot = tmp_path / "audit_report.png"
    browser.screenshot(shot, height=1500)
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (1280, 1500)
    if os.environ.get("REPRULES_UPDATE_SCREENSHOT") == "1":
        SCREENSHOT.write_bytes(png)


@pytest.fixture
def bwd_steps(tmp_path, monkeypatch):
    from helpers import BWD_STEPS

    (tmp_path / "bwd_steps.py").write_text(BWD_STEPS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("bwd_steps", None)


ROWS = r"""
(() => {
  const text = e => e.innerText.replace(/\s+/g, ' ').trim();
  return {
    summary: [...document.querySelectorAll('table.summary tr')].map(r => [...r.cells].map(text)),
    collectives: [...document.querySelectorAll('table.collectives')].map(t => [...t.querySelectorAll('tr.collective')]
      .map(r => [...r.cells].map(text))),
  };
})()
"""


def test_dead_and_reprules_added_collectives_are_shown_as_such(bwd_steps, browser):
    from helpers import NEW_SHARD_MAP

    seen = {}
    for step in ("both", "only_x"):
        page = bwd_steps / f"{step}.html"
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert _cli.main(["audit", f"bwd_steps:{step}", "--json", "--quiet", "--html", str(page)]) == 0
        doc = json.loads(out.getvalue())
        browser.open(page.resolve().as_uri())
        seen[step] = (doc["workloads"][0]["on"], browser.evaluate(ROWS))
    on, got = seen["only_x"]
    (dead,) = [c for c in on["collectives"] if c["dead"]]
    row = got["collectives"][-1][on["collectives"].index(dead)]  # the reprules side's table
    assert row[6] == "dead only in the jaxpr: dropped by lowering, never runs; not counted", row
    assert row[7] == "J . . dead code, not lowered", row
    (dead_row,) = [r for r in got["summary"] if r[0] == "dead (not counted)"]  # off: 1 on JAX <= 0.4
    assert dead_row[2] == "1" and dead_row[1] in ("0", "1"), got["summary"]
    needed = next(r for r in got["summary"] if r[0] == "needed")
    assert needed[2] == f"{on['needed_count']} ({on['needed_sent_bytes']:,} B)"
    on, got = seen["both"]
    (psum,) = [c for c in on["collectives"] if c["axes"] == ["data"]]
    row = got["collectives"][-1][on["collectives"].index(psum)]
    if NEW_SHARD_MAP:  # reprules adds it; JAX <= 0.5 psums the cotangent itself
        assert row[6] == "needed added by reprules to a custom_vjp bwd's cotangent", row
        bwd_line = (bwd_steps / "bwd_steps.py").read_text().splitlines().index("def scaled_bwd(res, g):") + 1
        assert row[9] == f"bwd_steps.py:{bwd_line}" and psum["source"].endswith(row[9]), (row, psum)
    else:
        assert row[6] == "needed", row
    assert "custom_vjp.py" not in " ".join(" ".join(r) for t in got["collectives"] for r in t)
