"""End-to-end trained tokens/s of asynchronous training (`--max-staleness K`) against the synchronous loop (K = 0).

The same run (tiny random Qwen3-VL trained by the real trainer, GRPO with TIS, the letter game with 3 turns per
episode, the same seed and config) is run once per K. The engine is the fake SGLang server
(`rollout/fake_engine.py`) serving from its own thread, as a real engine serves from its own process: it answers
each `/generate` with 4-12 tokens (`--tokens`) after a heavy-tailed latency, lognormal with median `--median-latency` and
sigma `--sigma` (capped at `--max-latency`), drawn from a hash of (group, sample, turn), so every mode meets the
same latencies for the same requests. A weight update's pause aborts the requests in flight, as SGLang's does.

Measured over the steps after `--warmup` (compilation): trained tokens (`batch/real_tokens`, what went through the
train step) per second of wall time, and each mode's step-time breakdown: the wait for the rollout (the whole
rollout in K = 0), train, weight update (export + load), engine idle/paused, overlap, staleness.

    .venv/bin/python scripts/bench_async.py [--steps 12] [--warmup 3] [--ks 0 1 2] [--json out.json]

The last line is `RATIO async/sync end-to-end: X` (K = 1 over K = 0; target >= 1.4). On a shared machine take
the ratio, not the absolute numbers. The fake engine costs no CPU, so the ratio is what overlap and streaming buy
for this balance of rollout and training; `--median-latency` and `--tokens` move that balance. Two effects add
up: generation overlaps training (at most (rollout + train) / max(rollout, train)), and a step no longer waits
for its slowest group (the stream hands the trainer the first groups to finish; the K = 0 baseline is the default
synchronous driver, without over-sampling).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from jaxrl_vlm.config import load_config  # noqa: E402
from jaxrl_vlm.job.run import train  # noqa: E402
from jaxrl_vlm.job.run_log import read_metrics  # noqa: E402
from rollout.fake_engine import Delay, FakeSGLangServer, RecordedRequest, Tokens  # noqa: E402

TARGET_RATIO = 1.4


def _unit(key: str, salt: str) -> float:
    """A uniform number in (0, 1) from a hash: the same request gets the same draw in every mode."""
    digest = hashlib.blake2b(f"{salt}:{key}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") + 0.5) / 2**64


def _request_key(record: RecordedRequest | dict[str, Any]) -> str:
    """`g<group>-s<index>-t<turn>` of the episode loop's rid (without its unique suffix and retry tag)."""
    body = record.body if isinstance(record, RecordedRequest) else record
    rid = str((body or {}).get("rid", ""))
    return "-".join(rid.split("-")[:3])


class LongTailEngine:
    """The fake SGLang server on its own event loop thread, with heavy-tailed latencies and varied lengths."""

    def __init__(self, median_s: float, sigma: float, max_s: float, token_ids: list[int], lengths: tuple[int, int]):
        self.median_s, self.sigma, self.max_s, self.token_ids = median_s, sigma, max_s, token_ids
        self.lengths = lengths
        self.url = ""
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._serve, name="bench-fake-engine", daemon=True)

    def latency(self, key: str) -> float:
        z = statistics.NormalDist().inv_cdf(_unit(key, "latency"))
        return min(self.max_s, self.median_s * math.exp(self.sigma * z))

    def _select(self, record: RecordedRequest) -> Any:
        return Delay(self.latency(_request_key(record)))

    def _generate(self, body: dict[str, Any]) -> Tokens:
        key = _request_key(body)
        low, high = self.lengths
        n = low + int(_unit(key, "length") * (high - low + 1))
        ids = [self.token_ids[int(_unit(f"{key}:{i}", "token") * len(self.token_ids))] for i in range(n)]
        stops = (body.get("sampling_params") or {}).get("stop_token_ids") or []
        ids.append(int(stops[0]))
        return Tokens(output_ids=tuple(ids), log_probs=tuple(-1.0 for _ in ids))

    def _serve(self) -> None:
        async def main() -> None:
            self._stop = asyncio.Event()
            server = FakeSGLangServer(script=self._select, generate_fn=self._generate)
            async with server:
                self.url = server.url
                self._loop = asyncio.get_running_loop()
                self._ready.set()
                await self._stop.wait()

        asyncio.run(main())

    def __enter__(self) -> "LongTailEngine":
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the fake engine did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


def _config(tmp: Path, url: str, k: int, args: argparse.Namespace) -> Any:
    return load_config(None, [
        "--hf-checkpoint", str(tmp / "tiny"), "--make-tiny",
        "--prompt-data", str(tmp / "prompts.jsonl"), "--prompt-style", "plain", "--system-prompt", "Answer briefly.",
        "--rollout-interaction-env-path", "envs.letter_game", "--max-turns", str(args.turns),
        "--engine-url", url, "--weight-sync-dtype", "float32",
        "--num-rollout", str(args.warmup + args.steps), "--rollout-batch-size", str(args.batch),
        "--n-samples-per-prompt", str(args.n), "--rollout-max-response-len", "96", "--lr", "1e-4",
        "--seq-buckets", "256", "--row-buckets", "4,8,16", "--patch-buckets", "0", "--logprob-chunk-size", "64",
        "--use-tis", "--save-interval", "0", "--output-dir", str(tmp / f"k{k}"), "--seed", "1234",
        "--rollout-seed", "7", "--max-staleness", str(k),
    ])


def _summary(records: list[dict[str, Any]], warmup: int, k: int) -> dict[str, Any]:
    timed = [r for r in records if r["step"] >= warmup]

    def mean(key: str) -> float:
        values = [r[key] for r in timed if key in r]
        return float(statistics.fmean(values)) if values else float("nan")

    wall = sum(r["perf/step_time"] for r in timed)
    tokens = sum(r.get("batch/real_tokens", 0.0) for r in timed)
    out = {
        "k": k, "steps": len(timed), "wall_s": wall, "trained_tokens": tokens, "tokens_per_s": tokens / wall,
        "step_s": mean("perf/step_time"), "rollout_wait_s": mean("perf/rollout_time"),
        "train_s": mean("perf/train_time"), "update_s": mean("perf/update_weights_time"),
        "samples_per_step": mean("rollout/samples"), "compiled_programs": timed[-1].get("batch/compiled_programs"),
    }
    if k > 0:
        out.update({
            "engine_idle_s": mean("async/engine_idle_s"), "engine_paused_s": mean("async/engine_paused_s"),
            "overlap_fraction": mean("async/overlap_fraction"),
            "staleness": {j: sum(r.get(f"async/staleness_{j}", 0.0) for r in timed) for j in range(k + 1)},
            "stale_groups": sum(r.get("async/stale_groups", 0.0) for r in timed),
            "offpolicy_token_frac": mean("async/offpolicy_token_frac"),
            "continued_requests": sum(r.get("async/continued_requests", 0.0) for r in timed),
        })
    return out


def _table(rows: list[dict[str, Any]]) -> str:
    head = ["K", "steps", "wall s", "tok/s", "step s", "rollout wait s", "train s", "update s", "engine idle s",
            "overlap", "staleness (samples per lag)", "stale groups"]
    lines = [head]
    for r in rows:
        async_cols = (["-", "-", "-", "-"] if r["k"] == 0 else [
            f"{r['engine_idle_s']:.2f}", f"{r['overlap_fraction']:.2f}",
            " ".join(f"{j}:{int(n)}" for j, n in r["staleness"].items()), f"{int(r['stale_groups'])}"])
        lines.append([str(r["k"]), str(r["steps"]), f"{r['wall_s']:.1f}", f"{r['tokens_per_s']:.0f}",
                      f"{r['step_s']:.2f}", f"{r['rollout_wait_s']:.2f}", f"{r['train_s']:.2f}",
                      f"{r['update_s']:.2f}", *async_cols])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    return "\n".join([fmt.format(*lines[0]), fmt.format(*["-" * w for w in widths]),
                      *(fmt.format(*line) for line in lines[1:])])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2], help="staleness bounds to run (0 is the baseline)")
    p.add_argument("--steps", type=int, default=12, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=3, help="untimed first steps (compilation)")
    p.add_argument("--batch", type=int, default=8, help="groups (prompts) per step")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--turns", type=int, default=3, help="model turns per episode")
    p.add_argument("--median-latency", type=float, default=0.25, help="median seconds per /generate")
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the latency (the tail)")
    p.add_argument("--max-latency", type=float, default=4.0, help="cap of one request's latency, seconds")
    p.add_argument("--tokens", type=int, nargs=2, default=[4, 12], metavar=("MIN", "MAX"),
                   help="tokens the engine answers per turn (before the stop token)")
    p.add_argument("--out", default=None, help="directory for the runs (default: a temporary one)")
    p.add_argument("--json", default=None, help="write the summaries here")
    args = p.parse_args(argv)
    if 0 not in args.ks or 1 not in args.ks:
        p.error("--ks must include 0 (the baseline) and 1 (the ratio)")
    logging.basicConfig(level=logging.WARNING)
    os.environ.pop("XLA_FLAGS", None)
    tmp = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench_async_"))
    tmp.mkdir(parents=True, exist_ok=True)
    with (tmp / "prompts.jsonl").open("w") as f:
        for i in range(64):
            f.write(json.dumps({"problem": f"Say something about number {i}.", "answer": "x", "images": []}) + "\n")
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start; runs in {tmp}")
    print(f"engine: fake SGLang, lognormal latency median {args.median_latency:g} s sigma {args.sigma:g} "
          f"(cap {args.max_latency:g} s), {args.tokens[0]}-{args.tokens[1]} tokens per turn; {args.batch} prompts x {args.n} samples x "
          f"{args.turns} turns per step; {args.warmup} warm-up + {args.steps} timed steps per mode")
    rows = []
    with LongTailEngine(args.median_latency, args.sigma, args.max_latency, list(range(300, 900)),
                        tuple(args.tokens)) as engine:
        for k in args.ks:
            t0 = time.perf_counter()
            train(_config(tmp, engine.url, k, args))
            records = read_metrics(tmp / f"k{k}" / "metrics.jsonl")
            rows.append(_summary(records, args.warmup, k))
            print(f"K={k}: done in {time.perf_counter() - t0:.0f} s (load average {os.getloadavg()[0]:.2f})",
                  flush=True)
    print()
    print(_table(rows))
    base = next(r for r in rows if r["k"] == 0)
    sync_parts = base["rollout_wait_s"] + base["train_s"] + base["update_s"]
    print(f"\nK=0 step = rollout {base['rollout_wait_s']:.2f} + train {base['train_s']:.2f} + update "
          f"{base['update_s']:.2f} = {sync_parts:.2f} s; overlapping whole steps alone would give "
          f"{sync_parts / max(base['rollout_wait_s'], base['train_s'] + base['update_s']):.2f}x (the stream also "
          "stops waiting for each step's slowest group)")
    for r in rows:
        if r["k"] > 0:
            print(f"K={r['k']}: {r['tokens_per_s'] / base['tokens_per_s']:.2f}x K=0 trained tokens/s; off-policy token "
                  f"share {r['offpolicy_token_frac']:.2f}; {int(r['continued_requests'])} requests cut by an update "
                  f"and continued")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    ratio = next(r for r in rows if r["k"] == 1)["tokens_per_s"] / base["tokens_per_s"]
    met = "met" if ratio >= TARGET_RATIO else "NOT met"
    print(f"RATIO async/sync end-to-end: {ratio:.2f}  (target >= {TARGET_RATIO}: {met})")


if __name__ == "__main__":
    main()
