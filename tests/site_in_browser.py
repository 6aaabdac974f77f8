"""Open every page of the built site in headless Chromium; fail on what a reader would see broken.

    mkdocs build --strict --site-dir /tmp/site
    python tests/site_in_browser.py /tmp/site [--diagrams DIR] [--page lessons/10_long_sequences/]

Serves the folder on 127.0.0.1 (a free port), opens each page at 1280 px wide, waits until its
diagrams and formulas are drawn, and reports, page by page:
- raw TeX on the page (`\\(`, `$$`, `\\frac`... outside code), a formula KaTeX did not render or
  could not parse;
- a Mermaid block that did not become an SVG (or became mermaid's syntax-error picture), or one
  shown as code;
- a broken image, a request that failed or went to another host (the site must work offline);
- a JavaScript error: an uncaught exception or a console error.
It also notes, without failing, a diagram scaled down so far that its text is under 10 px.

`--diagrams DIR` also saves a PNG of every diagram (each Mermaid SVG and image) and displayed
formula as shown at 1280 px, to look at. Standard library only: Chromium is driven through the
DevTools protocol over a pipe (`--remote-debugging-pipe`), so no port is opened for it and
nothing is installed.

Chromium: $COURSE_CHROMIUM, else `chromium` (Debian's package), `chromium-browser`,
`google-chrome` on PATH. Without one the check is skipped, with the reason (exit status 0).
Exit status 1 when a page has a problem.
"""

from __future__ import annotations

import argparse
import base64
import functools
import http.server
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

WIDTH, HEIGHT = 1280, 900
LOAD_TIMEOUT = 30.0  # s for a page's load event
DRAW_TIMEOUT = 45.0  # s for its diagrams and formulas, at most
SETTLED = 5.0  # s without any change after which a page that is not drawn yet is judged as it is
COMMAND_TIMEOUT = 30.0  # s for one DevTools command
MERMAID_FONT_PX = 16  # mermaid's default font size, before the SVG is scaled to the page
SMALL_TEXT_PX = 10  # a diagram scaled so far down that its text is smaller gets a note

# Chromium as the check needs it: headless, no GPU, and nothing that reaches for the network on
# its own (a closed network otherwise fills the log with refused connections).
FLAGS = [
    "--headless", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
    "--no-default-browser-check", "--disable-extensions", "--disable-default-apps",
    "--disable-dev-shm-usage", "--mute-audio", "--hide-scrollbars",
    "--disable-features=Translate,MediaRouter,OptimizationHints",
    f"--window-size={WIDTH},{HEIGHT}", "--remote-debugging-pipe",
]


def find_chromium() -> str | None:
    named = os.environ.get("COURSE_CHROMIUM")
    if named:
        return named if shutil.which(named) else None
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if shutil.which(name):
            return shutil.which(name)
    return None


class BrowserError(RuntimeError):
    pass


class NoChromium(Exception):
    pass


class Chromium:
    """One headless Chromium, driven over the DevTools protocol's pipe (fds 3 and 4 of the
    child: JSON messages, each ended by a NUL byte)."""

    def __init__(self, executable: str):
        self.profile = tempfile.mkdtemp(prefix="course-chromium-")
        self.log = open(Path(self.profile) / "stderr.log", "w+b")  # noqa: SIM115
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()

        def child_fds():  # the protocol's fds, at the numbers Chromium reads and writes
            os.dup2(to_child_r, 3)
            os.dup2(from_child_w, 4)

        flags = [*FLAGS, f"--user-data-dir={self.profile}"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            flags.append("--no-sandbox")  # Chromium refuses to run as root with its sandbox
        self.process = subprocess.Popen(
            [executable, *flags, "about:blank"], stdin=subprocess.DEVNULL,
            stdout=self.log, stderr=self.log, preexec_fn=child_fds, pass_fds=(3, 4),
            start_new_session=True)  # its own process group: close() ends every child of it
        os.close(to_child_r)
        os.close(from_child_w)
        self._next_id = 0
        self._replies: dict[int, dict] = {}
        self.events: list[dict] = []
        self._changed = threading.Condition()
        self._closed = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        buffer = b""
        while True:
            try:
                chunk = os.read(self._from_child, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                break
            buffer += chunk
            *messages, buffer = buffer.split(b"\0")
            with self._changed:
                for raw in messages:
                    message = json.loads(raw)
                    if "id" in message:
                        self._replies[message["id"]] = message
                    else:
                        self.events.append(message)
                self._changed.notify_all()
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def send(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float = COMMAND_TIMEOUT) -> dict:
        with self._changed:
            self._next_id += 1
            ident = self._next_id
        message = {"id": ident, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_child, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        with self._changed:
            while ident not in self._replies:
                left = deadline - time.monotonic()
                if self._closed or left <= 0:
                    raise BrowserError(f"{method}: no answer from Chromium in {timeout:.0f} s"
                                       if not self._closed else self.crashed(method))
                self._changed.wait(left)
            reply = self._replies.pop(ident)
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error'].get('message')}")
        return reply.get("result", {})

    def wait_for(self, method: str, session: str, since: int, timeout: float) -> dict | None:
        """The first event `method` of `session` from events[since:], waiting up to timeout."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for event in self.events[since:]:
                    if event.get("method") == method and event.get("sessionId") == session:
                        return event
                left = deadline - time.monotonic()
                if self._closed or left <= 0:
                    return None
                self._changed.wait(left)

    def events_since(self, since: int, forget: bool = False) -> list[dict]:
        with self._changed:
            events = self.events[since:]
            if forget:  # judged: keep the list short
                del self.events[since:]
        return events

    def crashed(self, doing: str) -> str:
        self.log.flush()
        self.log.seek(0)
        tail = self.log.read().decode(errors="replace")[-2000:]
        return f"Chromium exited while {doing} (status {self.process.poll()}):\n{tail}"

    def close(self):
        try:
            self.send("Browser.close", timeout=5)
        except (BrowserError, OSError):
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        try:  # what is left of its process group (renderers, zygotes)
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait()
        for fd in (self._to_child, self._from_child):
            try:
                os.close(fd)
            except OSError:
                pass
        self.log.close()
        shutil.rmtree(self.profile, ignore_errors=True)


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def serve(folder: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = functools.partial(QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)  # a free port
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


# What the page shows, polled until it is drawn: rendered Mermaid hosts (material replaces each
# <pre class="mermaid"> by a <div class="mermaid"> holding the SVG), formulas not yet rendered,
# images not yet loaded.
STATE_JS = """JSON.stringify([
  document.querySelectorAll("div.mermaid").length,
  [...document.querySelectorAll(".arithmatex")].filter(e => !e.querySelector(".katex")).length,
  [...document.images].filter(i => !i.complete).length,
  document.querySelectorAll(".katex").length])"""

# Text a reader sees that is TeX source: delimiters, or a command, outside code and outside
# KaTeX's own output (whose MathML keeps the source as an annotation).
RAW_TEX = (r"\$\$|\\\(|\\\)|\\\[|\\\]|\\(?:frac|sum|prod|sqrt|cdot|times|mathrm|mathbf|text|"
           r"left|right|le|ge|leq|geq|log|exp|max|min|alpha|beta|gamma|sigma|lambda|infty)\b|"
           r"\$[^\s$][^$\n]*?[_^\\{][^$\n]*?[^\s$]\$")
PROBLEMS_JS = r"""(() => {
  const problems = [];
  const quote = text => '"' + text.replace(/\s+/g, " ").trim() + '"';
  const raw = new RegExp(RAW_TEX);
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    const at = node.parentElement;
    if (!at || at.closest("pre, code, script, style, textarea, .katex, .katex-error, .arithmatex"))
      continue;
    const found = raw.exec(node.textContent);
    if (found) {
      const text = node.textContent, start = Math.max(0, found.index - 40);
      problems.push("raw TeX shown: " + quote(text.slice(start, found.index + 40)));
    }
  }
  for (const e of document.querySelectorAll(".arithmatex"))
    if (!e.querySelector(".katex"))
      problems.push("formula not rendered: " + quote(e.textContent.slice(0, 80)));
  for (const e of document.querySelectorAll(".katex-error"))
    problems.push("KaTeX could not parse a formula: " + (e.title || e.textContent).slice(0, 160));
  for (const e of document.querySelectorAll("code.language-mermaid, pre.mermaid"))
    problems.push("mermaid block shown as its source, not drawn: " +
                  quote(e.textContent.slice(0, 60)));
  for (const i of document.images)
    if (!i.complete || i.naturalWidth === 0)
      problems.push("broken image: " + i.getAttribute("src"));
  return JSON.stringify(problems);
})()""".replace("RAW_TEX", json.dumps(RAW_TEX))

# Code and output blocks a reader has to scroll sideways: how many, and the widest's overflow.
WIDE_CODE_JS = """JSON.stringify([...document.querySelectorAll("article pre > code")]
  .filter(e => e.scrollWidth > e.clientWidth + 1 && e.offsetParent !== null)
  .map(e => { const lines = e.textContent.split("\\n");
              const longest = Math.max(...lines.map(x => x.length));
              return [e.scrollWidth, e.clientWidth,
                      lines.find(l => l.length === longest).slice(0, 50)]; }))"""

# Where each diagram and displayed formula is, in page coordinates, for --diagrams.
DIAGRAMS_JS = """JSON.stringify([...document.querySelectorAll(
    "div.mermaid, article img, div.arithmatex")]
  .map(e => { const r = e.getBoundingClientRect();
              return [r.x + scrollX, r.y + scrollY, r.width, r.height]; }))"""


@dataclass
class PageReport:
    path: str
    problems: list[str] = field(default_factory=list)
    formulas: int = 0
    diagrams: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)  # printed, not failures


def mermaid_blocks(html: str) -> int:
    return len(re.findall(r'<pre class="mermaid"', html))


def event_problems(events: list[dict], session: str, base: str) -> list[str]:
    problems, urls = [], {}
    for event in events:
        if event.get("sessionId") != session:
            continue
        method, params = event["method"], event.get("params", {})
        if method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            # a parser's error says where on its next two lines (mermaid's does)
            text = " | ".join(line.strip() for line in text.splitlines()[:3])
            problems.append(f"uncaught JavaScript exception: {text[:300]}")
        elif method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
            text = " ".join(str(arg.get("value", arg.get("description", "")))
                            for arg in params.get("args", []))
            problems.append(f"console error: {text.splitlines()[0][:200] if text else '?'}")
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error" \
                and params["entry"].get("source") != "network":  # those: the Network events
            problems.append(f"browser error: {params['entry']['text'][:200]}")
        elif method == "Network.requestWillBeSent":
            url = urls[params["requestId"]] = params["request"]["url"]
            if not url.startswith((base, "data:", "blob:", "about:")):
                problems.append(f"fetched from the network (the site must work offline): {url}")
        elif method == "Network.responseReceived" and params["response"]["status"] >= 400:
            response = params["response"]
            problems.append(f"HTTP {response['status']} for {response['url']}")
        elif method == "Network.loadingFailed" and not params.get("canceled"):
            problems.append(f"request failed: {params.get('errorText')} for "
                            f"{urls.get(params['requestId'], '?')}")
    return problems


def svg_problems(browser: Chromium, session: str) -> tuple[int, list[str], list[str]]:
    """How many Mermaid hosts hold an SVG, those that hold mermaid's error picture, and notes on
    those whose text is drawn small: an SVG wider than the page is scaled down to fit, its text
    with it. Material attaches the SVG in a closed shadow root, which only DevTools (pierce) can
    look into."""
    root = browser.send("DOM.getDocument", {"depth": 0}, session)["root"]["nodeId"]
    hosts = browser.send("DOM.querySelectorAll", {"nodeId": root, "selector": "div.mermaid"},
                         session)["nodeIds"]
    drawn, problems, notes = 0, [], []
    for number, host in enumerate(hosts, 1):
        node = browser.send("DOM.describeNode", {"nodeId": host, "depth": 2, "pierce": True},
                            session)["node"]
        children = [child for shadow in node.get("shadowRoots", [])
                    for child in shadow.get("children", [])] + node.get("children", [])
        svgs = [child for child in children if child.get("nodeName", "").lower() == "svg"]
        if not svgs:
            continue
        attributes = dict(zip(svgs[0].get("attributes", [])[::2],
                              svgs[0].get("attributes", [])[1::2], strict=False))
        if attributes.get("aria-roledescription") == "error":
            problems.append(f"mermaid diagram {number} is mermaid's syntax-error picture")
        else:
            drawn += 1
        try:
            width = browser.send("DOM.getBoxModel", {"backendNodeId": svgs[0]["backendNodeId"]},
                                 session)["model"]["width"]
            natural = float(attributes.get("viewBox", "0 0 0 0").split()[2])
        except (BrowserError, IndexError, ValueError):
            continue  # not shown (in a closed <details>) or no viewBox: nothing to say
        text_px = MERMAID_FONT_PX * width / natural if natural else MERMAID_FONT_PX
        if text_px < SMALL_TEXT_PX:
            notes.append(f"mermaid diagram {number} is {natural:.0f} px wide, shown at "
                         f"{width:.0f} px: its text is about {text_px:.1f} px high")
    return drawn, problems, notes


def check_page(browser: Chromium, base: str, path: str, html: str,
               diagrams_to: Path | None) -> PageReport:
    report = PageReport(path)
    started = time.monotonic()
    target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = browser.send("Target.attachToTarget", {"targetId": target, "flatten": True})[
        "sessionId"]
    since = len(browser.events)
    try:
        for domain in ("Page", "Runtime", "Log", "Network", "DOM"):
            browser.send(f"{domain}.enable", session=session)
        browser.send("Emulation.setDeviceMetricsOverride", {
            "width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False}, session)
        navigated = browser.send("Page.navigate", {"url": base + path}, session)
        if navigated.get("errorText"):
            report.problems.append(f"could not open the page: {navigated['errorText']}")
            return report
        if browser.wait_for("Page.loadEventFired", session, since, LOAD_TIMEOUT) is None:
            report.problems.append(f"the page did not finish loading in {LOAD_TIMEOUT:.0f} s")

        def evaluate(expression: str):
            result = browser.send("Runtime.evaluate", {"expression": expression,
                                                       "returnByValue": True}, session)
            if "exceptionDetails" in result:
                raise BrowserError(f"the check's own script failed: {result['exceptionDetails']}")
            return json.loads(result["result"]["value"])

        wanted = mermaid_blocks(html)
        deadline, state, steady_since = started + DRAW_TIMEOUT, None, time.monotonic()
        while time.monotonic() < deadline:
            now = evaluate(STATE_JS)
            if now != state:
                state, steady_since = now, time.monotonic()
            hosts, math_left, images_left, _ = state
            if hosts >= wanted and math_left == 0 and images_left == 0:
                break
            if time.monotonic() - steady_since > SETTLED:
                break  # nothing changes any more: judge the page as it is
            time.sleep(0.1)
        drawn, problems, report.notes = svg_problems(browser, session)
        report.diagrams, report.formulas = drawn, state[3]
        if drawn < wanted:
            report.problems.append(
                f"{wanted - drawn} of the page's {wanted} mermaid diagrams did not render to SVG")
        report.problems += problems + evaluate(PROBLEMS_JS)
        wide = evaluate(WIDE_CODE_JS)
        if wide:
            most = max(wide, key=lambda w: w[0] - w[1])
            report.notes.append(f"{len(wide)} code blocks scroll sideways; the widest needs "
                                f"{most[0]} px of {most[1]} (\"{most[2]}\")")
        if diagrams_to is not None:
            save_diagrams(browser, session, evaluate(DIAGRAMS_JS), path, diagrams_to)
        report.problems += event_problems(browser.events_since(since), session, base)
    finally:
        browser.send("Target.closeTarget", {"targetId": target})
        browser.events_since(since, forget=True)
        report.seconds = time.monotonic() - started
    return report


def save_diagrams(browser: Chromium, session: str, boxes: list, path: str, folder: Path):
    name = path.strip("/").replace("/", "_").removesuffix(".html") or "index"
    for number, (x, y, width, height) in enumerate(boxes, 1):
        if width < 1 or height < 1:
            continue  # inside a closed <details>: not shown
        shot = browser.send("Page.captureScreenshot", {
            "format": "png", "captureBeyondViewport": True,
            "clip": {"x": x, "y": y, "width": width, "height": height, "scale": 1}}, session)
        (folder / f"{name}-{number}.png").write_bytes(base64.b64decode(shot["data"]))


def pages_of(site: Path) -> list[str]:
    pages = []
    for page in sorted(site.rglob("*.html")):
        relative = page.relative_to(site).as_posix()
        pages.append(relative.removesuffix("index.html"))  # "" is the home page
    return pages


def check_site(site: Path, only: list[str] | None = None, diagrams_to: Path | None = None,
               chromium: str | None = None, echo=print) -> list[PageReport]:
    chromium = chromium or find_chromium()
    if chromium is None:
        raise NoChromium("no Chromium found (looked for $COURSE_CHROMIUM, chromium, "
                         "chromium-browser, google-chrome on PATH)")
    paths = pages_of(site) if not only else only
    files = {path: site / (path + "index.html" if path == "" or path.endswith("/") else path)
             for path in paths}
    missing = [path for path, file in files.items() if not file.is_file()]
    if missing:
        raise ValueError(f"no such page in {site}: {missing}")
    if diagrams_to is not None:
        diagrams_to.mkdir(parents=True, exist_ok=True)
    browser = Chromium(chromium)  # before the server's thread: it starts with a preexec_fn
    server = None
    reports = []
    try:
        server, base = serve(site)
        version = browser.send("Browser.getVersion")["product"]
        echo(f"{version}, headless, {WIDTH} px wide; {len(paths)} pages served at {base}")
        for path in paths:
            report = check_page(browser, base, path, files[path].read_text(errors="replace"),
                                diagrams_to)
            reports.append(report)
            verdict = "ok" if not report.problems else f"{len(report.problems)} PROBLEMS"
            echo(f"  /{path:<48} {report.diagrams:>3} diagrams {report.formulas:>4} formulas "
                 f"{report.seconds:5.1f} s  {verdict}")
            for problem in report.problems:
                echo(f"      - {problem}")
            for note in report.notes:
                echo(f"      note: {note}")
    finally:
        browser.close()
        if server is not None:
            server.shutdown()
            server.server_close()
    return reports


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", type=Path, help="the built site's folder")
    parser.add_argument("--page", action="append", help="only this page (path under the site, "
                        "e.g. lessons/03_ddp/); repeatable")
    parser.add_argument("--diagrams", type=Path, help="save a PNG of every diagram here")
    args = parser.parse_args()
    if not (args.site / "index.html").is_file():
        parser.error(f"{args.site} has no index.html: build the site first")
    started = time.monotonic()
    try:
        reports = check_site(args.site, args.page, args.diagrams)
    except NoChromium as missing:
        print(f"site_in_browser: skipped: {missing}")
        return 0
    except ValueError as wrong:
        parser.error(str(wrong))
    bad = [report for report in reports if report.problems]
    print(f"{len(reports)} pages in {time.monotonic() - started:.1f} s: "
          + (f"{len(bad)} with problems ({', '.join('/' + r.path for r in bad)})" if bad
             else "every page drawn, no raw TeX, no broken image, no JavaScript error"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
