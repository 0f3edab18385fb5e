"""The viewer in a real browser: headless Chromium (Debian's `chromium`, installed by `.ci/run`) loads the exported
page and the served one; the DOM after load says how many pictures decoded, and how many episodes and turns the
page shows. Also takes a screenshot of each.

Marked `browser`: the default run leaves it out (pyproject addopts); `python -m pytest -m browser -n 0` runs it, and
then a missing Chromium FAILS the test, it is never skipped.
"""

from __future__ import annotations

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
    return {"episodes": len(re.findall(r'<article class="episode', dom)),
            "turns": len(re.findall(r'<div class="turn"', dom)),
            "images": len(re.findall(r"<img ", dom)),
            "loaded": attr("data-images-loaded"), "broken": attr("data-images-broken")}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_tokenizer, tiny_image_processor) -> Path:
    return build_run(tmp_path_factory.mktemp("viewer_browser"), tiny_tokenizer, tiny_image_processor)


def _expected(run: Path, sources) -> tuple[int, int, int]:
    eps = [e for s in sources for e in load_episodes(run, s)]
    images = sum(len(e.prompt_images) + sum(len(t.images) for t in e.turns) for e in eps)
    return len(eps), sum(len(e.turns) for e in eps), images


def test_the_exported_page_renders_its_pictures_in_chromium(run_dir, tmp_path):
    from jaxrl_vlm.viewer.server import export_html

    page = export_html(run_dir, tmp_path / "export.html")
    dom = _run_chromium("--dump-dom", page.as_uri(), home=tmp_path)
    counts = _dom_counts(dom)
    episodes, turns, images = _expected(run_dir, index_run(run_dir).sources)
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
