"""The trajectory viewer (`jaxrl-vlm view`, jaxrl_vlm/viewer/): what it reads from a run directory, the page it
serves (aiohttp, on loopback) and the self-contained page `--export` writes; plus the training-side option that
writes what it reads (`--dump-rollout-interval`). The page in a real browser: tests/test_viewer_browser.py.

The run directory is built, not downloaded: sokoban episodes through the real episode loop and chat template,
a scripted engine playing solutions, failures and wrong moves, dumped as training steps and eval rounds. Clips:
one episode encoded by the real encoder (Qwen3-VL and Qwen2.5-VL layouts), its frames dumped and played.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import html
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer
from PIL import Image

from jaxrl_vlm.config import load_config
from jaxrl_vlm.data.geo3k import load_styled_dataset
from jaxrl_vlm.job.assets import make_synthetic_data
from jaxrl_vlm.viewer import render
from jaxrl_vlm.viewer.records import RunIndex, Source, SourceKind, index_run, load_episodes
from jaxrl_vlm.viewer.server import _data_url, export_html, make_app, page_for
from rollout.dump import DumpError, dump_samples, validate_dump
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


# ----------------------------------------------------------------------------- clips
def _random_clip(seed: int, frames: int, size: tuple[int, int], fps: float):
    from rollout.video import Clip

    rng = np.random.default_rng(seed)
    return Clip.of(rng.integers(0, 256, (frames, size[1], size[0], 3), dtype=np.uint8), fps)


def build_clip_sample(processing_dir: Path):
    """(tokenizer, sample, clips in video_data order) of one episode: a prompt with clip A, a first turn whose
    observation holds a picture, clip B and clip A again, a last turn; encoded by the real encoder (timestamps and
    vision markers around every frame group for Qwen3-VL, one run of pads per clip for Qwen2.5-VL)."""
    from rollout.processing import load_image_processor, load_tokenizer
    from rollout.sample import Sample, Status, TurnRecord
    from rollout.video import load_video_processor_config

    encoder = ChatEncoder(load_tokenizer(processing_dir), load_image_processor(processing_dir),
                          video_config=load_video_processor_config(processing_dir))
    a, b = _random_clip(1, 5, (64, 48), 2.0), _random_clip(2, 3, (40, 40), 4.0)
    picture = Image.fromarray(np.random.default_rng(3).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    prompt = encoder.encode_prompt([{"role": "user", "content": [
        {"type": "video", "video": a}, {"type": "text", "text": "Where does it go?"}]}])
    first = encoder.tokenize("left") + [encoder.vision.im_end]
    obs = encoder.encode_observation([{"role": "user", "content": [
        {"type": "image", "image": picture}, {"type": "video", "video": b}, {"type": "video", "video": a},
        {"type": "text", "text": "Again."}]}])
    last = encoder.tokenize("up") + [encoder.vision.im_end]
    s = Sample(group_index=0, index=0, status=Status.COMPLETED, reward=1.0)
    s.tokens = prompt.train_ids + first + obs.train_ids + last
    s.response_length = len(first) + len(obs.train_ids) + len(last)
    s.loss_mask = [1] * len(first) + [0] * len(obs.train_ids) + [1] * len(last)
    s.rollout_log_probs = [-0.5] * len(first) + [0.0] * len(obs.train_ids) + [-0.25] * len(last)
    s.image_data = prompt.image_data + obs.image_data
    s.video_data = prompt.video_data + obs.video_data
    s.multimodal_train_inputs = {"video_grid_thw": np.concatenate([prompt.mm_inputs["video_grid_thw"],
                                                                   obs.mm_inputs["video_grid_thw"]])}
    s.turns = [TurnRecord(0, generated_tokens=len(first), observation_images=1, observation_clips=2),
               TurnRecord(1, generated_tokens=len(last))]
    return encoder.tokenizer, s, [a, b, a]


def build_clip_dump(root: Path, processing_dir: Path) -> Path:
    """The episode of `build_clip_sample` dumped with 32 px thumbnails (so every clip's frames are shrunk)."""
    tokenizer, sample, _ = build_clip_sample(processing_dir)
    dump_samples([sample], root / "clips.jsonl", tokenizer, thumbnail_px=32)
    return root / "clips.jsonl"


@pytest.fixture(params=["qwen3_vl", "qwen2_5_vl"])
def clip_family(request) -> Path:
    name = "tiny_processing_dir" if request.param == "qwen3_vl" else "tiny_qwen25_processing_dir"
    return request.getfixturevalue(name)


def _thumbnail(frame: np.ndarray, px: int) -> np.ndarray:
    image = Image.fromarray(frame)
    image.thumbnail((px, px))
    return np.asarray(image)


def test_a_dump_writes_every_clips_frames_in_order_and_gives_each_clip_to_its_turn(clip_family, tmp_path):
    tokenizer, sample, clips = build_clip_sample(clip_family)
    dump_samples([sample], tmp_path / "d.jsonl", tokenizer, thumbnail_px=32)
    (rec,) = validate_dump(tmp_path / "d.jsonl")
    refs = [*rec["prompt_clips"], *rec["turns"][0]["clips"]]
    assert (len(rec["prompt_clips"]), [len(t["clips"]) for t in rec["turns"]], rec["num_clips"]) == (1, [2, 0], 3)
    assert len(rec["turns"][0]["images"]) == 1 and rec["prompt_images"] == []  # a clip's markers are no picture
    for ref, clip in zip(refs, clips):
        assert ref["fps"] == clip.fps and len(ref["frames"]) == len(clip.frames)
        assert (ref["sent_width"], ref["sent_height"]) == (clip.frames.shape[2], clip.frames.shape[1])
        for file, frame in zip(ref["frames"], clip.frames):  # the frames in order, thumbnailed like pictures
            written = np.asarray(Image.open(tmp_path / file))
            assert written.shape == (ref["height"], ref["width"], 3) and max(written.shape) == 32
            assert np.array_equal(written, _thumbnail(frame, 32)), file
    assert refs[0]["frames"][0].endswith("g0_i0_clip0_f0.png") and refs[1]["frames"][2].endswith("_clip1_f2.png")
    # the turn's clips point at their first video-pad row, in order; a run of pads is one row
    rows = rec["turns"][0]["tokens"]
    assert [rows[c["row"]][0] for c in rec["turns"][0]["clips"]] == ["<|video_pad|>"] * 2
    n_pads = sample.tokens[sample.prompt_length:].count(tokenizer.convert_tokens_to_ids("<|video_pad|>"))
    assert sum(r[3] for r in rows if r[0] == "<|video_pad|>") == n_pads
    # decoded text: one pad per clip between the template's markers, no timestamps
    assert rec["prompt_text"].count("<|vision_start|><|video_pad|><|vision_end|>") == 1
    assert rec["turns"][0]["observation_text"].count("<|video_pad|>") == 2
    assert "seconds>" not in rec["prompt_text"] + rec["turns"][0]["observation_text"]
    # without the grids, or with grids that do not fit the pads, the token structure gives the same clips
    for grid in (None, {"video_grid_thw": np.array([[1, 2, 2]] * 3)}):
        sample.multimodal_train_inputs = grid
        dump_samples([sample], tmp_path / "e.jsonl", tokenizer, thumbnail_px=32)
        (again,) = validate_dump(tmp_path / "e.jsonl")
        assert json.dumps(again).replace("e_images/", "d_images/") == json.dumps(rec)


def test_validate_dump_refuses_a_missing_frame_and_a_bad_clip(tiny_processing_dir, tmp_path):
    dump = build_clip_dump(tmp_path, tiny_processing_dir)
    (rec,) = validate_dump(dump)
    frame = rec["turns"][0]["clips"][1]["frames"][2]
    (tmp_path / frame).unlink()
    with pytest.raises(DumpError, match=r"turns\[0\] key 'clips'\[1\]: frame 2 of 5, file .* is missing"):
        validate_dump(dump)
    dump = build_clip_dump(tmp_path, tiny_processing_dir)  # written again: every frame back
    for edit, message in ((lambda r: r["prompt_clips"][0].update(fps=0), "key 'fps' is 0"),
                          (lambda r: r["prompt_clips"][0].update(frames=[]), "non-empty list"),
                          (lambda r: r["turns"][0]["clips"][0].update(row=0), "key 'row' is 0"),
                          (lambda r: r.update(num_clips=2), "3 clip references, key 'num_clips' is only 2")):
        bad = json.loads(dump.read_text())
        edit(bad)
        (tmp_path / "bad.jsonl").write_text(json.dumps(bad) + "\n")
        with pytest.raises(DumpError, match=message):
            validate_dump(tmp_path / "bad.jsonl")
    tokenizer, sample, _ = build_clip_sample(tiny_processing_dir)
    sample.video_data[1] = "data:video/mp4;base64," + base64.b64encode(b"not a video").decode()
    with pytest.raises(DumpError, match=r"sample\(group=0, index=0\): video_data\[1\] does not decode"):
        dump_samples([sample], tmp_path / "corrupt.jsonl", tokenizer)


def _players(fragment: str) -> list[str]:
    return re.findall(r'<figure class="clip[^"]*".*?</figure>', fragment)


def test_the_viewer_shows_each_clip_as_a_player_with_its_frames_in_order(tiny_processing_dir, tmp_path):
    dump = build_clip_dump(tmp_path, tiny_processing_dir)
    index = index_run(dump)
    (ep,) = load_episodes(index.root, index.sources[0])
    assert [len(c.frames) for c in (*ep.prompt_clips, *ep.turns[0].clips)] == [5, 3, 5] and not ep.turns[1].clips
    section = render.render_source(index.sources[0], [ep], lambda path: "/file/" + path)
    players = _players(section)
    assert len(players) == 3
    for k, (player, ref) in enumerate(zip(players, (*ep.prompt_clips, *ep.turns[0].clips))):
        srcs = re.findall(r'<img class="frame" src="([^"]+)"', player)
        assert srcs == ["/file/" + f for f in ref.frames] and all(f"clip{[0, 1, 2][k]}_f" in s for s in srcs)
        assert re.findall(r'data-index="(\d+)"', player) == [str(j) for j in range(len(ref.frames))]
        assert player.count(" hidden>") == len(ref.frames) - 1  # the first frame shows before the script runs
        assert f'data-fps="{ref.fps!r}"' in player and f"{len(ref.frames)} frames at {ref.fps:g} fps" in player
        assert all(f'data-clip="{a}"' in player for a in ("play", "prev", "next"))
        assert f'class="clipseek" min="0" max="{len(ref.frames) - 1}"' in player
    prompt = section[section.index('<div class="prompt">'):section.index('<div class="turn"')]
    assert len(_players(prompt)) == 1 and "video_pad" not in prompt  # the player in place of the clip's pad
    turn = section[section.index('<div class="turn"'):]
    assert turn.index("[video x") < turn.index('<figure class="clip"')  # after the clip's first pads
    assert "function clipShow" in render.render_page(index, [section], nav_href=lambda s: "#" + s.key)
    compare = render.render_compare(index.sources[0], [ep], index.sources[0], [ep], lambda path: path)
    assert len(_players(compare)) == 1 + 2 * 2 and 'class="clip small"' in compare
    page = export_html(dump, tmp_path / "clips.html").read_text()  # exported: every frame embedded, in order
    frames = [ref.frames for ref in (*ep.prompt_clips, *ep.turns[0].clips)]
    embedded = [re.findall(r'<img class="frame" src="([^"]+)"', p) for p in _players(page)]
    assert embedded == [[_data_url(index.root)(f) for f in files] for files in frames]
