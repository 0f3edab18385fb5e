"""`jaxrl-vlm view RUN_DIR`: the trajectory viewer as a local web page (aiohttp), and `--export FILE.html`.

Routes: `/` shows the first training step (or dump); `/?source=KEY` one source (KEY is its path under the run,
e.g. `rollout/step_4.jsonl`, `eval/heldout/step_25.jsonl`); `/?source=A&compare=B` two eval rounds' answers side
by side above A's episodes; `/file/PATH` a picture or a clip's frame under the run directory (nothing outside it).
The run directory is re-indexed on every page load, so the steps of a run in progress appear as they are written.

`export_html(run, out)` writes one self-contained page: the first and last eval rounds of each set side by side,
then every source of the run, with every picture and every frame of each clip embedded as a data URL (a picture
shown twice is embedded twice). Its long lists page in the page's own script (`render`), so it needs no server; a
navigation link `#KEY` opens the page of sections that holds source KEY.

No jax.
"""

from __future__ import annotations

import base64
import logging
import urllib.parse
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from jaxrl_vlm.viewer.records import RunIndex, Source, SourceKind, index_run, load_episodes
from jaxrl_vlm.viewer.render import render_compare, render_page, render_source

logger = logging.getLogger(__name__)


def _href(source: Source) -> str:
    return "/?source=" + urllib.parse.quote(source.key)


def _file_url(path: str) -> str:
    return "/file/" + urllib.parse.quote(path)


def page_for(run: str | Path, source_key: str | None = None, compare_key: str | None = None) -> str:
    """The served page for one source (the first one by default), optionally with a side-by-side comparison."""
    index = index_run(run)
    source = index.get(source_key) if source_key else index.sources[0]
    sections = []
    current = [source.key]
    if compare_key:
        other = index.get(compare_key)
        current.append(other.key)
        sections.append(render_compare(source, load_episodes(index.root, source), other,
                                       load_episodes(index.root, other), _file_url))
    sections.append(render_source(source, load_episodes(index.root, source), _file_url))
    return render_page(index, sections, current=current, nav_href=_href, note=_compare_hint(index, source))


def _compare_hint(index: RunIndex, source: Source) -> str:
    if source.kind is not SourceKind.EVAL:
        return ""
    rounds = [s for s in index.evals if s.eval_set == source.eval_set and s.key != source.key]
    return f"(compare with another round: add &compare={rounds[-1].key})" if rounds else ""


def _data_url(root: Path) -> Callable[[str], str]:
    def embed(path: str) -> str:
        return "data:image/png;base64," + base64.b64encode((root / path).read_bytes()).decode("ascii")
    return embed


def export_html(run: str | Path, out: str | Path) -> Path:
    """Write the whole run as one self-contained page (pictures embedded); returns the path."""
    index = index_run(run)
    embed = _data_url(index.root)
    sections = []
    by_set: dict[str, list[Source]] = {}
    for source in index.evals:
        by_set.setdefault(source.eval_set or "", []).append(source)
    for rounds in by_set.values():
        if len(rounds) >= 2:
            a, b = rounds[0], rounds[-1]
            sections.append(render_compare(a, load_episodes(index.root, a), b, load_episodes(index.root, b), embed))
    for source in index.sources:
        sections.append(render_source(source, load_episodes(index.root, source), embed))
    page = render_page(index, sections, nav_href=lambda s: "#" + s.key, note="(exported)", page_sections=True)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out


def make_app(run: str | Path) -> web.Application:
    """The aiohttp application serving run directory (or dump file) `run`."""
    root = index_run(run).root.resolve()

    async def page(request: web.Request) -> web.Response:
        try:
            text = page_for(run, request.query.get("source"), request.query.get("compare"))
        except (KeyError, ValueError) as e:
            raise web.HTTPNotFound(text=str(e)) from None
        return web.Response(text=text, content_type="text/html")

    async def file(request: web.Request) -> web.FileResponse:
        path = (root / request.match_info["path"]).resolve()
        if not path.is_relative_to(root) or not path.is_file():
            raise web.HTTPNotFound(text=f"no file {request.match_info['path']!r} under {root}")
        return web.FileResponse(path)

    app = web.Application()
    app.router.add_get("/", page)
    app.router.add_get("/file/{path:.+}", file)
    return app


def serve(run: str | Path, host: str = "127.0.0.1", port: int = 8765) -> None:
    """Serve the viewer until interrupted."""
    print(f"jaxrl-vlm view: serving {run} at http://{host}:{port}/", flush=True)
    web.run_app(make_app(run), host=host, port=port, print=None)
