"""Rollout host overhead: (a) client-side time per turn with many concurrent episodes, (b) finalize cost vs turns.

(a) `--episodes` (512) concurrent 3-turn episodes run through the real driver and episode loop (tiny Qwen-style
    tokenizer and chat template, delta encoding, prefix-stability check at finalize) against a zero-latency
    fake SGLang server. The server runs in **its own process** (`python -m rollout.fake_engine`), as SGLang does:
    in-process, its request parsing and JSON answers would run on the client's event loop and be billed as
    client overhead. Reported: wall time / turns. Baselines from the same run, same server, same concurrency:
    the raw HTTP round trip of a pre-serialized `/generate` body (bare aiohttp), and `SGLangClient.generate`
    (client + answer parsing). Overhead per turn = loop per turn - raw round trip per request.
(b) Finalize (one-time merge of image tensors, response decode, chat-template re-render check, reward) for
    episodes of 3 and 20 turns with an image in every observation, timed around `rollout.multiturn._finalize`
    with an in-process fake server (only finalize is timed). Linear growth means time/turn stays flat, i.e. the
    20/3 time ratio stays near 20/3 = 6.7 (a per-turn re-concatenation would give ~(20/3)^2 = 44).

    .venv/bin/python scripts/bench_rollout.py [--episodes 512] [--repeats 3] [--json out.json]

Numbers are wall-clock on a shared machine: take the best of `--repeats` and read ratios, not absolutes. In a
microVM the first write to memory the process has never touched can cost tens of microseconds per 4 KiB page
(the host backs guest pages lazily), which makes the first multi-megabyte merge look superlinear; (b) therefore
warms up at the largest size before timing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402

from envs.base import BaseInteractionEnv  # noqa: E402
from rollout import multiturn  # noqa: E402
from rollout.client import RetryPolicy, SGLangClient  # noqa: E402
from rollout.driver import generate_rollout  # noqa: E402
from rollout.encoding import ChatEncoder  # noqa: E402
from rollout.fake_engine import FakeSGLangServer, Tokens  # noqa: E402
from rollout.multiturn import RolloutContext, default_sampling_params  # noqa: E402
from rollout.processing import load_image_processor, load_tokenizer  # noqa: E402
from rollout.sample import Sample, Status  # noqa: E402

TARGET_MS_PER_TURN = 2.0
REPLY_TEXT = "Let me think. The angle is 30 degrees, so x = 7."


class ScriptedToolEnv(BaseInteractionEnv):
    """`turns` model turns: a short observation (optionally with an image) after each but the last, then done.

    `step` is async, so it runs on the event loop: a sync step would cost a worker-thread hop per turn.
    """

    def __init__(self, turns: int, image: Any = None):
        self.turns = turns
        self.image = image
        self.steps = 0

    def reset(self) -> None:
        self.steps = 0

    async def step(self, response_text: str):
        self.steps += 1
        if self.steps >= self.turns:
            return {"obs_str": ""}, True, {}
        obs: dict[str, Any] = {"obs_str": f"Tool result {self.steps}: the value is {self.steps * 7}. Continue."}
        if self.image is not None:
            obs["multi_modal_data"] = {"image": [self.image]}
        return obs, False, {}

    def verdict(self) -> float:
        return 1.0


def env_module(turns: int, image: Any = None) -> types.ModuleType:
    module = types.ModuleType("bench_env")
    module.build_env = lambda sample, args: ScriptedToolEnv(turns, image)
    return module


class Prompts:
    def __init__(self, image_url: str | None = None):
        self.k = 0
        self.image_url = image_url

    def next_batch(self) -> list[Sample]:
        out = []
        for _ in range(64):
            content: Any = f"Problem {self.k}: find x in the triangle, then report it."
            if self.image_url is not None:
                content = [{"type": "image", "image": self.image_url}, {"type": "text", "text": content}]
            out.append(Sample(prompt=[{"role": "user", "content": content}], label="7", index=self.k))
            self.k += 1
        return out


def make_args(ctx: RolloutContext, *, groups: int, n: int, turns: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        rollout_batch_size=groups, n_samples_per_prompt=n, over_sampling_batch_size=None, dynamic_filter=None,
        partial_rollout=False, mask_offpolicy_in_partial_rollout=False,
        custom_generate_function_path="rollout.multiturn.generate",
        rollout_max_response_len=100_000, rollout_max_context_len=None, max_turns=turns, max_env_retries_per_turn=0,
        env_step_timeout=60.0, episode_timeout=600.0, delta_check="strict", rollout_temperature=1.0,
        rollout_top_p=1.0, rollout_top_k=-1, rollout_stop_token_ids=[], rollout_context=ctx,
    )


# ----------------------------------------------------------------------------- (a) per-turn overhead
def start_server_process(reply_ids: list[int], eos: int) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "rollout.fake_engine", "--port", "0", "--eos-token-id", str(eos),
           "--response-ids", *map(str, reply_ids)]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError(f"fake engine did not start: {line!r} {proc.stderr.read() if proc.stderr else ''}")
    return proc, line.strip().rsplit(" ", 1)[-1]


async def bench_loop(client: SGLangClient, encoder: ChatEncoder, episodes: int, turns: int, n: int) -> dict[str, float]:
    """One rollout step of `episodes` concurrent episodes through the driver; wall time per model turn."""
    ctx = RolloutContext(client=client, encoder=encoder, env_module=env_module(turns),
                         generate_slots=asyncio.Semaphore(episodes))
    args = make_args(ctx, groups=episodes // n, n=n, turns=turns)
    t0 = time.perf_counter()
    result = await generate_rollout(args, 0, Prompts())
    wall = time.perf_counter() - t0
    samples = result.samples
    bad = [s for s in samples if s.status is not Status.COMPLETED] + list(result.failed)
    if bad or len(samples) != episodes:
        raise RuntimeError(f"benchmark episodes did not all complete: {len(samples)} kept, {len(bad)} bad "
                           f"({bad[0].metadata.get('error') if bad else ''})")
    n_turns = sum(len(s.turns) for s in samples)
    return {"wall_s": wall, "turns": n_turns, "ms_per_turn": 1e3 * wall / n_turns}


def typical_body(encoder: ChatEncoder, reply_ids: list[int]) -> dict[str, Any]:
    """A /generate body the size of a mid-episode request (prompt + one model turn + one observation)."""
    seg = encoder.encode_prompt([{"role": "user", "content": "Problem 0: find x in the triangle, then report it."}])
    obs = encoder.encode_observation([{"role": "user", "content": "Tool result 1: the value is 7. Continue."}])
    ids = seg.wire_ids + reply_ids + obs.wire_ids
    vision = encoder.vision
    return {"rid": "bench", "input_ids": ids, "return_logprob": True,
            "sampling_params": default_sampling_params(types.SimpleNamespace(rollout_max_response_len=512),
                                                       vision.banned_ids, vision.eos_ids)}


async def bench_raw_http(session: aiohttp.ClientSession, url: str, body: dict[str, Any], requests: int,
                         concurrency: int) -> dict[str, float]:
    """Pre-serialized bodies posted with bare aiohttp: the transport and server floor of one turn."""
    payload = json.dumps(body).encode()
    sem = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with sem:
            async with session.post(url + "/generate", data=payload,
                                    headers={"Content-Type": "application/json"}) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"raw /generate answered HTTP {resp.status}")

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(requests)))
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "turns": requests, "ms_per_turn": 1e3 * wall / requests}


async def bench_client(client: SGLangClient, body: dict[str, Any], requests: int, concurrency: int) -> dict[str, float]:
    """The same requests through `SGLangClient.generate` (body building, JSON, answer checks)."""
    sem = asyncio.Semaphore(concurrency)

    async def one(k: int) -> None:
        async with sem:
            await client.generate(body["input_ids"], sampling_params=body["sampling_params"], rid=f"c{k}")

    t0 = time.perf_counter()
    await asyncio.gather(*(one(k) for k in range(requests)))
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "turns": requests, "ms_per_turn": 1e3 * wall / requests}


def run_overhead(encoder: ChatEncoder, episodes: int, turns: int, n: int, repeats: int, in_process: bool) -> dict[str, Any]:
    """Best-of-`repeats` ms/turn of the three paths, interleaved; pools are opened and warmed once, as in a run."""
    reply_ids = encoder.tokenize(REPLY_TEXT)
    body = typical_body(encoder, reply_ids + [encoder.vision.im_end])
    requests = episodes * turns

    async def all_runs(url: str) -> dict[str, list[dict[str, float]]]:
        out: dict[str, list[dict[str, float]]] = {"raw_http": [], "client": [], "loop": []}
        connector = aiohttp.TCPConnector(limit=episodes, keepalive_timeout=600)
        async with aiohttp.ClientSession(connector=connector) as session, \
                SGLangClient(url, max_connections=episodes, timeout_s=120.0, keepalive_timeout_s=600.0,
                             retry=RetryPolicy(max_retries=0)) as client:
            # Warm-up: open every pooled connection and run each path once (template, tokenizer caches).
            await bench_raw_http(session, url, body, episodes, episodes)
            await bench_client(client, body, episodes, episodes)
            await bench_loop(client, encoder, episodes, turns, n)
            for _ in range(repeats):
                out["raw_http"].append(await bench_raw_http(session, url, body, requests, episodes))
                out["client"].append(await bench_client(client, body, requests, episodes))
                out["loop"].append(await bench_loop(client, encoder, episodes, turns, n))
        return out

    if in_process:
        async def in_proc() -> dict[str, list[dict[str, float]]]:
            from rollout.fake_engine import default_generate_fn

            async with FakeSGLangServer(generate_fn=default_generate_fn(reply_ids, encoder.vision.im_end),
                                        eos_token_id=encoder.vision.im_end) as server:
                return await all_runs(server.url)

        runs = asyncio.run(in_proc())
    else:
        proc, url = start_server_process(reply_ids, encoder.vision.im_end)
        try:
            runs = asyncio.run(all_runs(url))
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    best = {k: min(v, key=lambda r: r["ms_per_turn"]) for k, v in runs.items()}
    return {"runs": runs, "best": best,
            "overhead_ms_per_turn": best["loop"]["ms_per_turn"] - best["raw_http"]["ms_per_turn"]}


# ----------------------------------------------------------------------------- (b) finalize vs turns
def run_finalize(encoder: ChatEncoder, turn_counts: list[int], episodes: int, repeats: int, image: Any,
                 image_url: str) -> dict[int, Any]:
    """Median finalize (and merge-only) time per episode for each turn count.

    Untimed passes at the largest size first grow the heap and fault its pages in; then the sizes alternate for
    `repeats` rounds, so drift on a shared machine hits every size alike.
    """
    timings: dict[str, list[float]] = {"finalize": [], "merge": []}
    original_finalize, original_merge = multiturn._finalize, multiturn.merge_multimodal_chunks

    async def timed_finalize(*a: Any, **kw: Any) -> None:
        t0 = time.perf_counter()
        await original_finalize(*a, **kw)
        timings["finalize"].append(time.perf_counter() - t0)

    def timed_merge(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        out = original_merge(*a, **kw)
        timings["merge"].append(time.perf_counter() - t0)
        return out

    reply = encoder.tokenize(REPLY_TEXT) + [encoder.vision.im_end]

    async def run(turns: int) -> list[Sample]:
        async with FakeSGLangServer(generate_fn=lambda body: Tokens(tuple(reply)), eos_token_id=encoder.vision.im_end,
                                    image_token_id=encoder.vision.image_pad) as server:
            async with SGLangClient(server.url, retry=RetryPolicy(max_retries=0)) as client:
                ctx = RolloutContext(client=client, encoder=encoder, env_module=env_module(turns, image),
                                     generate_slots=asyncio.Semaphore(64))
                # One episode per step, one step at a time, so finalize timings never overlap other work.
                args = make_args(ctx, groups=1, n=1, turns=turns)
                prompts = Prompts(image_url)
                samples = []
                for _ in range(episodes):
                    samples += (await generate_rollout(args, 0, prompts)).samples
                return samples

    collected: dict[int, dict[str, list[float]]] = {t: {"finalize": [], "merge": []} for t in turn_counts}
    shapes: dict[int, dict[str, int]] = {}
    multiturn._finalize, multiturn.merge_multimodal_chunks = timed_finalize, timed_merge
    try:
        for _ in range(2):  # untimed warm-up: see the module docstring on first-touch memory
            asyncio.run(run(max(turn_counts)))
        for _ in range(repeats):
            for turns in turn_counts:
                timings["finalize"].clear()
                timings["merge"].clear()
                samples = asyncio.run(run(turns))
                if len(samples) != episodes or any(s.status is not Status.COMPLETED for s in samples):
                    raise RuntimeError(f"finalize benchmark: episodes of {turns} turns did not complete")
                for key in ("finalize", "merge"):
                    collected[turns][key] += timings[key]
                mm = samples[0].multimodal_train_inputs
                shapes[turns] = {"images": int(mm["image_grid_thw"].shape[0]),
                                 "patch_rows": int(mm["pixel_values"].shape[0]), "tokens": len(samples[0].tokens)}
    finally:
        multiturn._finalize, multiturn.merge_multimodal_chunks = original_finalize, original_merge
    return {t: {**shapes[t], "finalize_ms": 1e3 * statistics.median(collected[t]["finalize"]),
                "merge_ms": 1e3 * statistics.median(collected[t]["merge"])} for t in turn_counts}


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=512, help="concurrent episodes (and the generate-slot limit)")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--n-samples", type=int, default=4, help="samples per prompt (episodes / n groups)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--in-process", action="store_true", help="run the fake engine on the client's event loop")
    p.add_argument("--finalize-turns", type=int, nargs="+", default=[3, 20], help="turn counts to compare")
    p.add_argument("--finalize-episodes", type=int, default=5)
    p.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    a = p.parse_args(argv)
    if a.episodes % a.n_samples:
        p.error("--episodes must be a multiple of --n-samples")

    from jaxrl_vlm.tiny_assets import save_tiny_processing
    from rollout.processing import image_to_data_url

    with tempfile.TemporaryDirectory() as tmp:
        proc_dir = save_tiny_processing(Path(tmp) / "tiny")
        encoder = ChatEncoder(load_tokenizer(proc_dir), load_image_processor(proc_dir))
    from PIL import Image
    import numpy as np

    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (96, 96, 3), dtype=np.uint8))
    image_url = image_to_data_url(image)

    overhead = run_overhead(encoder, a.episodes, a.turns, a.n_samples, a.repeats, a.in_process)
    finalize = run_finalize(encoder, list(a.finalize_turns), a.finalize_episodes, a.repeats, image, image_url)

    best = overhead["best"]
    where = "in-process" if a.in_process else "separate process"
    print(f"\n(a) client-side overhead, {a.episodes} concurrent episodes x {a.turns} turns, zero-latency fake engine "
          f"({where}), best of {a.repeats}")
    print(f"{'path':<34}{'requests':>10}{'wall s':>10}{'ms/turn':>10}")
    labels = {"raw_http": "raw HTTP round trip (aiohttp)", "client": "SGLangClient.generate",
              "loop": "driver + episode loop"}
    for key in ("raw_http", "client", "loop"):
        r = best[key]
        print(f"{labels[key]:<34}{r['turns']:>10}{r['wall_s']:>10.3f}{r['ms_per_turn']:>10.3f}")
    ok = overhead["overhead_ms_per_turn"] < TARGET_MS_PER_TURN
    print(f"{'overhead (loop - raw HTTP)':<34}{'':>10}{'':>10}{overhead['overhead_ms_per_turn']:>10.3f}"
          f"   target < {TARGET_MS_PER_TURN} ms: {'PASS' if ok else 'FAIL'}")
    per_run = {k: ", ".join(f"{r['ms_per_turn']:.3f}" for r in v) for k, v in overhead["runs"].items()}
    print("all runs, ms/turn: " + "; ".join(f"{k} [{v}]" for k, v in per_run.items()))

    sizes = sorted(set(a.finalize_turns))
    print(f"\n(b) finalize time, an image in the prompt and in every observation "
          f"(median of {a.finalize_episodes} x {a.repeats} episodes)")
    print(f"{'turns':>6}{'images':>8}{'patch rows':>12}{'tokens':>8}{'finalize ms':>13}{'ms/turn':>9}{'merge ms':>10}")
    for turns in sizes:
        r = finalize[turns]
        print(f"{turns:>6}{r['images']:>8}{r['patch_rows']:>12}{r['tokens']:>8}{r['finalize_ms']:>13.3f}"
              f"{r['finalize_ms'] / turns:>9.3f}{r['merge_ms']:>10.3f}")
    ratios = {}
    for lo, hi in zip(sizes, sizes[1:]):
        ratio = finalize[hi]["finalize_ms"] / finalize[lo]["finalize_ms"]
        merge_ratio = finalize[hi]["merge_ms"] / finalize[lo]["merge_ms"]
        ratios[f"{hi}/{lo}"] = {"finalize": ratio, "merge": merge_ratio, "linear": hi / lo}
        print(f"{hi}/{lo} turns: finalize time x{ratio:.2f}, merge x{merge_ratio:.2f} (linear x{hi / lo:.2f}, "
              f"quadratic x{(hi / lo) ** 2:.1f}); per-turn cost x{ratio / (hi / lo):.2f}")

    numbers = {"overhead": overhead, "finalize": finalize, "finalize_ratios": ratios}
    if a.json is not None:
        a.json.write_text(json.dumps(numbers, indent=2, default=float))
    return numbers


if __name__ == "__main__":
    main()
