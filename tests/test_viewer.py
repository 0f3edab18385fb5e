"""The trajectory viewer (`jaxrl-vlm view`, jaxrl_vlm/viewer/): what it reads from a run directory, the page it
serves (aiohttp, on loopback) and the self-contained page `--export` writes; plus the training-side option that
writes what it reads (`--dump-rollout-interval`). The page in a real browser: tests/test_viewer_browser.py.

The run directory is built, not downloaded: sokoban episodes through the real episode loop and chat template,
a scripted engine playing solutions, failures and wrong moves, dumped as training steps and eval rounds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import html
import re
import shutil
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from jaxrl_vlm.config import load_config
from jaxrl_vlm.data.geo3k import load_styled_dataset
from jaxrl_vlm.job.assets import make_synthetic_data
from jaxrl_vlm.viewer import render
from jaxrl_vlm.viewer.records import RunIndex, Source, SourceKind, index_run, load_episodes
from jaxrl_vlm.viewer.server import export_html, make_app, page_for
from rollout.dump import DumpError, dump_samples
from rollout.encoding import ChatEncoder
from test_agent_envs import _rollout, _scripted_replies

#: Per prompt of the demo run: the solution, wrong moves (unsolved), nothing (the engine fails: FAILED).
PLANS = ("solve", "solve", "wrong", "fail")


def build_run(root: Path, tokenizer, image_processor) -> Path:
    """A run directory with training steps 0 and 2 and eval rounds 0 and 2 of set `heldout` (sokoban)."""
    cfg = load_config("configs/sokoban_tiny.yaml", ["--prompt-data", str(root / "p.parquet")])
    make_synthetic_data(cfg, root / "p.parquet", len(PLANS), seed=0)
    data = load_styled_dataset(str(root / "p.parquet"), "plain")
    samples = [data[i] for i in range(len(data))]
    replies = []
    for k, (sample, plan) in enumerate(zip(samples, PLANS)):
        sample.group_index, sample.index = k, 0
        replies.append({"solve": _scripted_replies("sokoban", sample), "wrong": ["up", "up", "up", "up"], "fail": []}[plan])
    encoder = ChatEncoder(tokenizer, image_processor)
    episodes = asyncio.run(_rollout(cfg, encoder, samples, replies))
    run = root / "run"
    for step in (0, 2):
        dump_samples(episodes, run / "rollout" / f"step_{step}.jsonl", tokenizer, max_samples=3 if step else None)
        dump_samples(episodes, run / "eval" / "heldout" / f"step_{step}.jsonl", tokenizer)
    return run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_tokenizer, tiny_image_processor) -> Path:
    return build_run(tmp_path_factory.mktemp("viewer"), tiny_tokenizer, tiny_image_processor)


def test_the_run_index_lists_training_steps_then_eval_rounds(run_dir):
    index = index_run(run_dir)
    assert [(s.kind, s.step, s.eval_set) for s in index.sources] == [
        (SourceKind.TRAIN, 0, None), (SourceKind.TRAIN, 2, None),
        (SourceKind.EVAL, 0, "heldout"), (SourceKind.EVAL, 2, "heldout")]
    episodes = load_episodes(index.root, index.sources[0])
    assert [e.status for e in episodes] == ["completed", "completed", "completed", "failed"]
    assert episodes[2].reward < 0 and episodes[2].zero_reward  # four moves into the wall, unsolved
    solved = episodes[0]
    assert solved.reward > 0.5 and len(solved.prompt_images) == 1
    assert all(len(t.images) == 1 for t in solved.turns[:-1]) and solved.turns[0].tokens
    assert episodes[3].failed and episodes[3].errors and episodes[3].zero_reward
    assert len(load_episodes(index.root, index.sources[1])) == 3  # the per-step cap


def test_a_lone_dump_file_is_a_run_and_an_empty_dir_is_an_error(run_dir, tmp_path):
    index = index_run(run_dir / "rollout" / "step_0.jsonl")
    assert [s.kind for s in index.sources] == [SourceKind.DUMP]
    with pytest.raises(ValueError, match="no dumps"):
        index_run(tmp_path)


def _counts(page: str) -> tuple[int, int, int]:
    return (len(re.findall(r'<article class="(?:item )?episode', page)),
            len(re.findall(r'<div class="(?:item )?turn"', page)), page.count("<img "))


def test_the_served_page_shows_episodes_turns_pictures_and_token_masks(run_dir):
    async def go():
        async with TestClient(TestServer(make_app(run_dir))) as client:
            first = await (await client.get("/")).text()
            ev = await (await client.get("/?source=eval/heldout/step_2.jsonl&compare=eval/heldout/step_0.jsonl")).text()
            img = re.search(r'src="(/file/[^"]+)"', first).group(1)
            picture = await client.get(img)
            escape = await client.get("/file/..%2F..%2Fetc%2Fpasswd")
            missing = await client.get("/?source=rollout/step_9.jsonl")
            return first, ev, picture.status, picture.headers["Content-Type"], escape.status, missing.status

    first, ev, status, ctype, escape, missing = asyncio.run(go())
    episodes = load_episodes(run_dir, index_run(run_dir).sources[0])
    turns = sum(len(e.turns) for e in episodes)
    images = sum(len(e.prompt_images) + sum(len(t.images) for t in e.turns) for e in episodes)
    assert _counts(first) == (4, turns, images)
    assert status == 200 and ctype == "image/png" and escape == 404 and missing == 404
    assert 'class="tok m1"' in first and 'class="tok m0"' in first and "log p = -0.5000" in first
    assert "FAILED" in first and "termination" in first and "weight versions" in first and "env retries" in first
    assert "Side by side" in ev and ev.count('<tr class="item crow"') == 4
    for flag in ("data-failed", "data-truncated", "data-zero"):
        assert flag in first


def test_export_writes_one_self_contained_page(run_dir, tmp_path):
    out = export_html(run_dir, tmp_path / "page.html")
    page = out.read_text()
    assert "/file/" not in page and page.count('src="data:image/png;base64,') == page.count("<img ")
    n_episodes = sum(len(load_episodes(run_dir, s)) for s in index_run(run_dir).sources)
    assert _counts(page)[0] == n_episodes and "Side by side" in page
    moved = tmp_path / "elsewhere.html"  # nothing it shows lives next to the run
    shutil.copy(out, moved)
    assert moved.read_text() == page


def _section(page: str, marker: str) -> str:
    """The `<section>` whose opening tag holds `marker`."""
    i = page.rindex("<section", 0, page.index(marker))
    return page[i : page.index("</section>", i)]


def test_the_comparison_shows_each_prompts_and_each_turns_pictures_and_actions(run_dir, tmp_path):
    page = export_html(run_dir, tmp_path / "page.html").read_text()
    compare = _section(page, 'source compare"')
    index = index_run(run_dir)
    a, b = (load_episodes(run_dir, index.get(f"eval/heldout/step_{k}.jsonl")) for k in (0, 2))
    thumbs = sum(len(e.prompt_images) for e in a) + sum(len(t.images) for e in a + b for t in e.turns)
    assert compare.count('<img class="thumb" src="data:image/png;base64,') == thumbs > len(a)
    assert "image_pad" not in compare and "im_start" not in compare  # the pictures, not their pads
    solved = a[0]  # sokoban, played to the end: every move and every picture after it
    assert len(solved.turns) > 2
    row = compare[compare.index('<tr class="item crow"'):]
    row = row[: row.index("</tr>")]
    actions = re.findall(r'<span class="act">([^<]*)</span>', row)
    assert actions == [html.escape(t.model_text.replace("<|im_end|>", "").strip()) for e in (solved, b[0])
                       for t in e.turns]  # both sides
    assert actions[0] in ("up", "down", "left", "right")
    assert row.count('<img class="thumb"') == len(solved.prompt_images) + 2 * sum(len(t.images) for t in solved.turns)
    first = _section(page, 'id="rollout/step_0.jsonl"')  # the episode view: pictures in place of the pads too
    assert "&lt;|image_pad|&gt;" not in first and '<pre>' in first and "prompt picture 0" in first


def _pages(fragment: str, what: str) -> str:
    return re.search(fr'<span class="pageinfo">(page \d+ of \d+ \({what} [^)]*\))</span>', fragment).group(1)


def _shown(fragment: str, tag: str) -> int:
    return len(re.findall(fr'<{tag} class="item(?: [^"]*)?"(?![^>]* hidden)[^>]*>', fragment))


def test_every_long_list_pages_and_its_first_page_is_the_one_shown(run_dir):
    index = index_run(run_dir)
    source = index.get("eval/heldout/step_0.jsonl")
    eps = load_episodes(run_dir, source)
    many = [dataclasses.replace(eps[k % len(eps)], group_index=k) for k in range(120)]
    src = lambda path: path  # noqa: E731
    section = render.render_source(source, many, src)
    assert _pages(section, "episodes") == "page 1 of 3 (episodes 1\u201350 of 120)"
    assert _shown(section, "article") == render.EPISODES_PER_PAGE and section.count(" hidden>") >= 70
    assert 'data-act="next"' in section and 'data-act="prev"' in section
    compare = render.render_compare(source, many, source, many, src)
    assert _pages(compare, "rows") == "page 1 of 3 (rows 1\u201350 of 120)" and _shown(compare, "tr") == 50
    assert "<img " in compare[: compare.index('<tr class="item crow" hidden')]  # a picture on the first page
    long = dataclasses.replace(eps[0], turns=eps[0].turns * 12)
    turns = render.render_source(source, [long], src)
    assert _pages(turns, "turns") == f"page 1 of {-(-len(long.turns) // 20)} (turns 1\u201320 of {len(long.turns)})"
    assert _shown(turns, "div") == render.TURNS_PER_PAGE
    short = render.render_source(source, eps, src)  # a short list: no pager in sight, nothing hidden
    assert '<div class="pager" hidden>' in short and " hidden>" not in short.replace('<div class="pager" hidden>', "")
    steps = [Source(SourceKind.TRAIN, source.path.with_name(f"step_{k}.jsonl"), k) for k in range(60)]
    page = render.render_page(RunIndex(run_dir, tuple(steps)), [section] * 12, nav_href=lambda s: "#" + s.key,
                              page_sections=True)
    assert _pages(page, "sources") == "page 1 of 2 (sources 1\u201350 of 60)" and _shown(page, "a") == 50
    assert _pages(page, "sections") == "page 1 of 2 (sections 1\u201310 of 12)" and _shown(page, "section") == 10


def test_the_viewer_refuses_a_dump_whose_picture_is_missing(run_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(run_dir / "rollout", broken / "rollout")
    next((broken / "rollout" / "step_0_images").glob("*.png")).unlink()
    index = index_run(broken)
    with pytest.raises(DumpError, match="is missing"):
        load_episodes(index.root, index.sources[0])
    with pytest.raises(DumpError):
        page_for(broken)


def test_cli_view_export(run_dir, tmp_path, capsys):
    from jaxrl_vlm.cli import main

    assert main(["view", str(run_dir), "--export", str(tmp_path / "x.html")]) == 0
    assert (tmp_path / "x.html").is_file()
    assert main(["view", str(tmp_path / "nothing_here")]) == 2
    assert "not a run directory" in capsys.readouterr().err


def test_dump_rollout_interval_is_one_declared_option():
    cfg = load_config("configs/sokoban_tiny.yaml", ["--dump-rollout-interval", "5", "--dump-rollout-max-samples", "4"])
    assert (cfg.debug.dump_rollout_interval, cfg.debug.dump_rollout_max_samples) == (5, 4)
    assert load_config("configs/sokoban_tiny.yaml").debug.dump_rollout_interval == 0
    with pytest.raises(Exception, match="dump_rollout_max_samples"):
        load_config("configs/sokoban_tiny.yaml", ["--dump-rollout-max-samples", "0"])


def test_the_viewer_and_the_agent_tasks_never_import_jax():
    import subprocess
    import sys

    code = ("import sys, jaxrl_vlm.viewer.server, envs.sokoban.synthetic, envs.zoom.synthetic, envs.gui.synthetic; "
            "print(sorted(m for m in ('jax', 'flax', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
