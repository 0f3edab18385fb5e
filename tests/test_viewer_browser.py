"""The viewer in a real browser: headless Chromium (Debian's `chromium`, installed by `.ci/run`) loads the exported
page and the served one; the DOM after load says how many pictures decoded, and how many episodes and turns the
page shows. Also takes a screenshot of each. A clip's player, driven over the DevTools protocol, steps and plays
through its frames in order at the clip's fps.

Marked `browser`: the default run leaves it out (pyproject addopts); `python -m pytest -m browser -n 0` runs it, and
then a missing Chromium FAILS the test, it is never skipped.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from jaxrl_vlm.viewer.records import index_run, load_episodes
from test_viewer import build_run

pytestmark = pytest.mark.browser

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
#: Chromium's flags for a root user in a container: no sandbox, no GPU, no first-run UI.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         "--hide-scrollbars", "--virtual-time-budget=10000")


def chromium() -> str:
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    pytest.fail("no Chromium found (looked for " + ", ".join(CHROMIUM_NAMES) + "): `apt-get install -y chromium` "
                "(.ci/run does) to run the browser tests")


def _run_chromium(*args: str, home: Path) -> str:
    env = {**os.environ, "HOME": str(home)}  # a writable profile directory
    out = subprocess.run([chromium(), *FLAGS, f"--user-data-dir={home / 'profile'}", *args], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def _dom_counts(dom: str) -> dict[str, int]:
    body = re.search(r"<body([^>]*)>", dom).group(1)
    attr = lambda name: int(re.search(fr'{name}="(\d+)"', body).group(1))  # noqa: E731
    return {"episodes": len(re.findall(r'<article class="(?:item )?episode', dom)),
            "turns": len(re.findall(r'<div class="(?:item )?turn"', dom)),
            "images": len(re.findall(r"<img ", dom)),
            "loaded": attr("data-images-loaded"), "broken": attr("data-images-broken")}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_tokenizer, tiny_image_processor) -> Path:
    return build_run(tmp_path_factory.mktemp("viewer_browser"), tiny_tokenizer, tiny_image_processor)


def _expected(run: Path, sources) -> tuple[int, int, int]:
    eps = [e for s in sources for e in load_episodes(run, s)]
    images = sum(len(e.prompt_images) + sum(len(t.images) for t in e.turns) for e in eps)
    return len(eps), sum(len(e.turns) for e in eps), images


def _compare_thumbs(run: Path, a: str, b: str) -> int:
    """The pictures of a side-by-side comparison of eval rounds `a` and `b`: each prompt's once, each turn's."""
    index = index_run(run)
    a_eps, b_eps = load_episodes(run, index.get(a)), load_episodes(run, index.get(b))
    return sum(len(e.prompt_images) for e in a_eps) + sum(len(t.images) for e in a_eps + b_eps for t in e.turns)


def test_the_exported_page_renders_its_pictures_in_chromium(run_dir, tmp_path):
    from jaxrl_vlm.viewer.server import export_html

    page = export_html(run_dir, tmp_path / "export.html")
    dom = _run_chromium("--dump-dom", page.as_uri(), home=tmp_path)
    counts = _dom_counts(dom)
    episodes, turns, images = _expected(run_dir, index_run(run_dir).sources)
    images += _compare_thumbs(run_dir, "eval/heldout/step_0.jsonl", "eval/heldout/step_2.jsonl")
    assert (counts["episodes"], counts["turns"], counts["images"]) == (episodes, turns, images), counts
    assert counts["loaded"] == images > 0 and counts["broken"] == 0, counts
    shot = tmp_path / "export.png"
    _run_chromium(f"--screenshot={shot}", "--window-size=1280,1400", page.as_uri(), home=tmp_path)
    assert shot.stat().st_size > 10_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_served_page_renders_its_pictures_in_chromium(run_dir, tmp_path):
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "jaxrl_vlm.cli", "view", str(run_dir), "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}/?source=eval/heldout/step_2.jsonl"
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(url, timeout=2).read()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    why = server.stdout.read() if server.poll() is not None else "timeout"
                    pytest.fail(f"`jaxrl-vlm view` did not serve {url}: {why}")
                time.sleep(0.3)
        dom = _run_chromium("--dump-dom", url, home=tmp_path)
        counts = _dom_counts(dom)
        index = index_run(run_dir)
        episodes, turns, images = _expected(run_dir, [index.get("eval/heldout/step_2.jsonl")])
        assert (counts["episodes"], counts["turns"], counts["images"]) == (episodes, turns, images), counts
        assert counts["loaded"] == images > 0 and counts["broken"] == 0, counts
        shot = tmp_path / "served.png"
        _run_chromium(f"--screenshot={shot}", "--window-size=1280,1400", url, home=tmp_path)
        assert shot.stat().st_size > 10_000
        if os.environ.get("JAXRL_VLM_VIEWER_SCREENSHOT"):  # how docs/viewer.png is made
            shutil.copy(shot, os.environ["JAXRL_VLM_VIEWER_SCREENSHOT"])
    finally:
        server.terminate()
        server.wait(timeout=30)


class DevTools:
    """Headless Chromium driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`: the browser reads
    commands on fd 3 and answers on fd 4, one JSON message per NUL-terminated chunk): nothing listens on a port,
    and nothing beyond the standard library drives it."""

    def __init__(self, home: Path, width: int = 1280, height: int = 900):
        to_browser, to_browser_w = os.pipe()
        from_browser_r, from_browser = os.pipe()

        self._log = home / "devtools-chromium.log"  # a file, not a pipe: a chatty browser never blocks on it

        def child() -> None:  # in the child: our pipe ends as its fds 3 and 4 (dup'ed first: dup2(3, 3) is a no-op)
            a, b = os.dup(to_browser), os.dup(from_browser)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.proc = subprocess.Popen(
            [chromium(), *(f for f in FLAGS if not f.startswith("--virtual-time")), "--remote-debugging-pipe",
             f"--window-size={width},{height}", f"--user-data-dir={home / 'devtools-profile'}", "about:blank"],
            preexec_fn=child, close_fds=False, stdout=subprocess.DEVNULL, stderr=self._log.open("wb"),
            env={**os.environ, "HOME": str(home)})
        os.close(to_browser)
        os.close(from_browser)
        self._w = os.fdopen(to_browser_w, "wb", buffering=0)
        self._r = os.fdopen(from_browser_r, "rb", buffering=0)
        self._buf, self._id, self.session = b"", 0, None

    def call(self, method: str, **params):
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if self.session and not method.startswith(("Target.", "Browser.")):
            msg["sessionId"] = self.session
        self._w.write(json.dumps(msg).encode() + b"\0")
        while True:
            while b"\0" not in self._buf:
                chunk = self._r.read(1 << 16)
                assert chunk, f"Chromium closed the DevTools pipe: {self._log.read_text(errors='replace')[-2000:]}"
                self._buf += chunk
            raw, self._buf = self._buf.split(b"\0", 1)
            answer = json.loads(raw)
            if answer.get("id") == self._id:
                assert "error" not in answer, (method, answer["error"])
                return answer["result"]

    def open(self, url: str) -> None:
        target = self.call("Target.createTarget", url=url)["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        deadline = time.monotonic() + 60
        while not self.eval("document.readyState === 'complete' && document.body.dataset.imagesLoaded !== undefined"):
            assert time.monotonic() < deadline, f"{url} did not finish loading"
            time.sleep(0.05)

    def eval(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def screenshot(self, path: Path) -> Path:
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot")["data"]))
        return path

    def close(self) -> None:
        try:
            self.call("Browser.close")
            self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(timeout=30)
            self._w.close()
            self._r.close()


def long_run(run: Path, dst: Path, copies: int = 15) -> Path:
    """`run`'s two eval rounds, each episode `copies` times under new group indexes (the same pictures): a run
    whose lists are longer than a page."""
    for k in (0, 2):
        src = run / "eval" / "heldout" / f"step_{k}.jsonl"
        out = dst / "eval" / "heldout" / src.name
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(src.with_name(f"step_{k}_images"), out.with_name(f"step_{k}_images"))
        records = [json.loads(line) for line in src.read_text().splitlines()]
        lines = [json.dumps({**r, "group_index": r["group_index"] + 1000 * c}) for c in range(copies) for r in records]
        out.write_text("\n".join(lines) + "\n")
    return dst


#: The page's state a test reads: per paged list its indicator and shown items, and the pictures in the first screen.
_STATE = """(() => {
  const box = sel => document.querySelector(sel).closest('.paged');
  const info = b => b.querySelector('.pageinfo').textContent;
  const shown = b => b._pager.items.filter(i => !i.hidden);
  const rows = box('tr.crow'), eps = box('article.episode');
  const inView = el => {
    const r = el.getBoundingClientRect(); return r.width > 0 && r.top < innerHeight && r.bottom > 0; };
  const firstImg = [...document.querySelectorAll('img')].find(i => inView(i) && i.complete && i.naturalWidth > 0);
  return {rows: info(rows), rowsShown: shown(rows).length, episodes: info(eps), episodesShown: shown(eps).length,
          rowPictures: shown(rows).flatMap(r => [...r.querySelectorAll('img')]).filter(i => i.naturalWidth > 0).length,
          firstShownRow: shown(rows)[0].querySelector('.meta').textContent,
          firstScreen: +document.body.dataset.imagesFirstScreen,
          firstImgInCompare: !!(firstImg && firstImg.closest('.compare'))};
})()"""


def test_a_long_runs_exported_page_pages_and_opens_on_pictures(run_dir, tmp_path):
    from jaxrl_vlm.viewer.server import export_html

    run = long_run(run_dir, tmp_path / "long")
    page = export_html(run, tmp_path / "long.html")
    n = len(load_episodes(run, index_run(run).get("eval/heldout/step_0.jsonl")))
    assert n > 50
    browser = DevTools(tmp_path)
    try:
        browser.open(page.as_uri())
        state = browser.eval(_STATE)
        # the first screen shows pictures, and the first one is the comparison's
        assert state["firstScreen"] > 0 and state["firstImgInCompare"], state
        assert state["rows"] == f"page 1 of 2 (rows 1\u201350 of {n})" and state["rowsShown"] == 50, state
        assert state["episodes"] == f"page 1 of 2 (episodes 1\u201350 of {n})" and state["episodesShown"] == 50, state
        assert state["rowPictures"] >= 50
        browser.screenshot(tmp_path / "long_page1.png")
        browser.eval("document.querySelector('tr.crow').closest('.paged').querySelector('[data-act=next]').click()")
        state = browser.eval(_STATE)
        assert state["rows"] == f"page 2 of 2 (rows 51\u2013{n} of {n})" and state["rowsShown"] == n - 50, state
        assert state["rowPictures"] >= n - 50 and state["firstShownRow"].startswith("group "), state
        browser.eval("document.querySelector('tr.crow').closest('.paged').querySelector('[data-act=prev]').click()")
        assert browser.eval(_STATE)["rows"].startswith("page 1 of 2"), state
        # filters page over what they leave; a link to an episode opens the page that holds it
        failed = browser.eval("(() => { const f = document.querySelector('[data-filter=failed]'); f.click();"
                              " return +document.getElementById('shown').textContent; })()")
        assert 0 < failed < n and browser.eval(_STATE)["episodes"].startswith(f"page 1 of 1 (episodes 1\u2013"), failed
        browser.eval("document.querySelector('[data-filter=failed]').click()")
        last = browser.eval("[...document.querySelectorAll('article.episode')].slice(-1)[0].id")
        browser.eval(f"location.hash = {json.dumps('#' + last)}")
        time.sleep(0.2)
        assert browser.eval(f"!document.getElementById({json.dumps(last)}).hidden"), last
        assert browser.eval("[...document.querySelectorAll('.paged')].some(b => b.dataset.page === '2')")
        assert browser.screenshot(tmp_path / "long_hash.png").stat().st_size > 10_000
    finally:
        browser.close()


#: The first clip player's state: its current frame, the frames shown (decoded and visible), the indicator and slider.
_CLIP_STATE = """(() => {
  const f = document.querySelector('figure.clip');
  const shown = [...f.querySelectorAll('img.frame')].filter(
      i => !i.hidden && i.getBoundingClientRect().width > 0 && i.complete && i.naturalWidth > 0);
  return {frame: +f.dataset.frame, shown: shown.map(i => +i.dataset.index), playing: f.dataset.playing || '0',
          info: f.querySelector('.clipinfo').textContent, seek: +f.querySelector('.clipseek').value,
          button: f.querySelector('[data-clip=play]').textContent};
})()"""


def test_a_clip_player_steps_and_plays_through_its_frames_in_order(tmp_path, tiny_processing_dir):
    from jaxrl_vlm.viewer.server import export_html
    from test_viewer import build_clip_dump

    (tmp_path / "clips").mkdir()
    page = export_html(build_clip_dump(tmp_path / "clips", tiny_processing_dir), tmp_path / "clips.html")
    browser = DevTools(tmp_path)
    click = "document.querySelector('figure.clip [data-clip={}]').click()"
    try:
        browser.open(page.as_uri())
        assert browser.eval("document.querySelectorAll('figure.clip').length") == 3
        assert browser.eval(_CLIP_STATE) == {"frame": 0, "shown": [0], "playing": "0", "info": "frame 1 / 5",
                                            "seek": 0, "button": "play"}
        for action, frame in (("next", 1), ("next", 2), ("prev", 1), ("prev", 0), ("prev", 4), ("next", 0)):
            browser.eval(click.format(action))
            state = browser.eval(_CLIP_STATE)
            assert (state["frame"], state["shown"], state["seek"], state["info"]) == (
                frame, [frame], frame, f"frame {frame + 1} / 5"), (action, state)
        browser.eval("(() => { const s = document.querySelector('figure.clip .clipseek'); s.value = 3;"
                     " s.dispatchEvent(new Event('input')); })()")
        assert browser.eval(_CLIP_STATE)["shown"] == [3]
        browser.eval(click.format("next"))  # back to frame 4, then play from there: 4, 0, 1, ... at 2 fps
        # record every frame change with its time while the clip plays for 1.3 s
        browser.eval("(() => { const f = document.querySelector('figure.clip'); window.seen = [];"
                     " new MutationObserver(() => seen.push([+f.dataset.frame, performance.now()]))"
                     ".observe(f, {attributes: true, attributeFilter: ['data-frame']}); })()")
        browser.call("Page.bringToFront")  # a visible page: its timers are not throttled
        browser.eval(click.format("play"))
        assert browser.eval(_CLIP_STATE)["playing"] == "1" and browser.eval(_CLIP_STATE)["button"] == "pause"
        time.sleep(1.3)
        browser.eval(click.format("play"))  # pause
        state = browser.eval(_CLIP_STATE)
        seen = browser.eval("seen")
        assert state["playing"] == "0" and state["button"] == "play" and state["shown"] == [state["frame"]]
        assert [f for f, _ in seen][:2] == [0, 1], seen  # in order, wrapping after the last frame
        gaps = [b - a for (_, a), (_, b) in zip(seen, seen[1:])]
        assert gaps and all(300 < g < 1000 for g in gaps), (seen, browser.eval("document.visibilityState"))  # 500 ms
        time.sleep(0.7)
        assert browser.eval(_CLIP_STATE)["frame"] == state["frame"]  # paused: no more steps
        browser.screenshot(tmp_path / "clips.png")
    finally:
        browser.close()
