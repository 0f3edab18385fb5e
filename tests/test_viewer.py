"""The trajectory viewer (`jaxrl-vlm view`, jaxrl_vlm/viewer/): what it reads from a run directory, the page it
serves (aiohttp, on loopback) and the self-contained page `--export` writes; plus the training-side option that
writes what it reads (`--dump-rollout-interval`). The page in a real browser: tests/test_viewer_browser.py.

The run directory is built, not downloaded: sokoban episodes through the real episode loop and chat template,
a scripted engine playing solutions, failures and wrong moves, dumped as training steps and eval rounds.
"""

from __future__ import annotations

import asyncio
import re
import shutil
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from jaxrl_vlm.config import load_config
from jaxrl_vlm.data.geo3k import load_styled_dataset
from jaxrl_vlm.job.assets import make_synthetic_data
from jaxrl_vlm.viewer.records import SourceKind, index_run, load_episodes
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
    return page.count('<article class="episode'), page.count('<div class="turn"'), page.count("<img ")


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
    assert "Side by side" in ev and ev.count("<tr>") == 1 + 4
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
