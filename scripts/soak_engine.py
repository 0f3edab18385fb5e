"""Soak and load test of `jaxrl-vlm serve`: N concurrent clients for T seconds, with faults, measured.

    python scripts/soak_engine.py [--clients 6] [--duration 300] [--json soak.json]
    python scripts/soak_engine.py --url http://127.0.0.1:30000 --model DIR [--server-pid PID]

Without `--url` it builds a tiny random Qwen3-VL (`jaxrl-vlm make-tiny`, nothing downloaded) unless `--model`
names one, starts `jaxrl-vlm serve` on a free loopback port with a small KV memory (so the prefix cache evicts
and requests may be retracted), and stops it at the end. With `--url` it drives a running server; `--model` then
names the served checkpoint (its tokenizer and image processor encode the prompts) and `--server-pid` the server
process whose RSS is sampled.

Traffic (every client is one asyncio task, seeded by `--seed` and its index, so a run is reproducible up to timing):
episodes of 1..`--max-turns` turns on prompts drawn from a fixed pool (so clients share prefixes in the radix
cache), half of them with an image; each later turn re-sends the whole conversation plus an observation (some
with a new image), as the rollout does. Prompts are encoded with the rollout's `ChatEncoder` and sent with its
`SGLangClient` (compact image placeholders, PNG data URLs, the rollout's sampling params). Faults injected:

* abort: the request is sent with its own rid and `/abort_request` names that rid mid-generation;
* drop: the client closes the connection mid-request (a client timeout, no retry), which the server must treat
  as an abort;
* greedy probes: a fixed prompt at temperature 0, compared with the answer of the quiet engine before the load.

Measured and printed (`--json PATH` also writes it): requests sent, answered and failed by cause (injected faults
apart from unexpected failures); p50/p99 latency of answered requests; the server's RSS over time; KV pages still
held by requests once the load settled, and pages not free after `/flush_cache`, against the idle baseline read
the same way before the load (the engine's `/get_server_info` `internal_states[0].kv_pages`); greedy answers
during and after the load against the quiet reference.

Exit status 1 when any check fails: an unexpected failure, a page held or leaked, a greedy mismatch, the server
gone, or RSS growth over a bound. The engine compiles one program per new shape, and each adds to its RSS for
good, so warm-up lasts `--warmup` seconds and then until no program was compiled for `--warmup-quiet` seconds (at
most half the load), and RSS is judged twice: all growth after warm-up (the highest RSS of the last quarter of
the post-warm-up window minus the RSS at its start), late compilations included, within
`--rss-growth-bound-mib`; and the leak bound, the drift over the second half of the load away from compilations
(`rss_drift_between_compiles`), within `--rss-drift-bound-mib`. Setup failures (no model, a server never
healthy, a server without page accounting, an engine that does not go idle after the load) exit 2 with the
reason.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import enum
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from PIL import Image

from rollout.client import EngineError, EngineRequestError, EngineResponseError, EngineUnavailable, GenerateResult, RetryPolicy, SGLangClient
from rollout.encoding import ChatEncoder, EncodedSegment
from rollout.multiturn import default_sampling_params
from rollout.options import RolloutOptions
from rollout.processing import load_image_processor, load_tokenizer
from rollout.sglang_wire import FinishType


class SetupError(RuntimeError):
    """The soak could not start: no model, a server that never became healthy, a server without page accounting."""


# ------------------------------------------------------------------------------------------ options


@dataclass(frozen=True)
class SoakOptions:
    """Every knob of one soak run (defaults sized for a busy 2-core machine). Times in seconds."""

    clients: int = 6
    duration_s: float = 300.0
    warmup_s: float = 60.0  # at least this long; then until no program was compiled for warmup_quiet_s
    warmup_quiet_s: float = 15.0
    max_turns: int = 3
    max_new_tokens: int = 24
    image_fraction: float = 0.5  # episodes whose prompt has an image
    abort_fraction: float = 0.1  # requests aborted by rid mid-generation
    drop_fraction: float = 0.1  # requests whose connection the client closes mid-request
    greedy_fraction: float = 0.1  # episodes that are a greedy probe instead
    fault_delay_s: tuple[float, float] = (0.01, 0.25)  # abort / drop this long after sending
    fault_max_new_tokens: int = 192  # a faulted request generates this long (EOS ignored): the fault lands mid-way
    greedy_tokens: int = 16
    request_timeout_s: float = 180.0
    settle_timeout_s: float = 60.0  # for in-flight requests and aborts to finish after the load
    rss_interval_s: float = 1.0
    # All growth after warm-up, late compilations included: one compilation of the tiny model's programs adds 5 to
    # 45 MiB for good, and a 300 s run may still compile two or three after warm-up.
    rss_growth_bound_mib: float = 128.0
    # The leak bound: growth over the second half of the load away from compilations (measured: 0 to 2 MiB).
    rss_drift_bound_mib: float = 8.0
    seed: int = 0
    # The server this script starts (ignored with url).
    max_batch: int = 8
    max_seq_len: int = 512
    max_total_tokens: int = 1024  # 64 pages of 16: the prefix cache evicts, and long requests get retracted
    startup_timeout_s: float = 300.0
    url: str | None = None
    server_pid: int | None = None
    model: str | None = None
    workdir: str | None = None
    json_path: str | None = None

    def __post_init__(self) -> None:
        if self.clients < 1:
            raise ValueError(f"--clients must be >= 1, got {self.clients}")
        if not 0 <= self.warmup_s < self.duration_s:
            raise ValueError(f"--warmup ({self.warmup_s}) must be in [0, --duration={self.duration_s})")
        for name in ("image_fraction", "abort_fraction", "drop_fraction", "greedy_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(self, name)}")
        if self.abort_fraction + self.drop_fraction > 1.0:
            raise ValueError("--abort-fraction + --drop-fraction must be <= 1")
        if self.max_turns < 1 or self.max_new_tokens < 1 or self.greedy_tokens < 1:
            raise ValueError("--max-turns, --max-new-tokens and --greedy-tokens must be >= 1")
        if self.url is not None and self.model is None:
            raise ValueError("--url needs --model: the served checkpoint's tokenizer and image processor encode the prompts")

    @property
    def max_requests_per_client(self) -> int:
        """A count bound on each client's loop besides the clock (a request takes well over 10 ms)."""
        return int(self.duration_s * 100) + 1


def parse_options(argv: Sequence[str] | None = None) -> SoakOptions:
    d = SoakOptions()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=d.clients, help="Concurrent clients.")
    p.add_argument("--duration", type=float, default=d.duration_s, help="Seconds of load.")
    p.add_argument("--warmup", type=float, default=d.warmup_s,
                   help="Seconds of load before RSS growth is measured (longer while programs still compile).")
    p.add_argument("--warmup-quiet", type=float, default=d.warmup_quiet_s,
                   help="Warm-up ends once no program was compiled for this long (at most half the load).")
    p.add_argument("--max-turns", type=int, default=d.max_turns, help="Most turns of one episode.")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="Tokens generated per turn.")
    p.add_argument("--image-fraction", type=float, default=d.image_fraction, help="Episodes whose prompt has an image.")
    p.add_argument("--abort-fraction", type=float, default=d.abort_fraction, help="Requests aborted by rid mid-generation.")
    p.add_argument("--drop-fraction", type=float, default=d.drop_fraction, help="Requests whose connection is closed mid-request.")
    p.add_argument("--greedy-fraction", type=float, default=d.greedy_fraction, help="Episodes that are greedy probes.")
    p.add_argument("--greedy-tokens", type=int, default=d.greedy_tokens, help="Tokens of a greedy probe.")
    p.add_argument("--request-timeout", type=float, default=d.request_timeout_s, help="Seconds one request may take.")
    p.add_argument("--settle-timeout", type=float, default=d.settle_timeout_s, help="Seconds for the engine to go idle after the load.")
    p.add_argument("--rss-interval", type=float, default=d.rss_interval_s, help="Seconds between RSS samples.")
    p.add_argument("--rss-growth-bound-mib", type=float, default=d.rss_growth_bound_mib,
                   help="Most RSS growth after warm-up (MiB), late compilations included.")
    p.add_argument("--rss-drift-bound-mib", type=float, default=d.rss_drift_bound_mib,
                   help="Most RSS growth over the second half of the load away from compilations (MiB): the leak bound.")
    p.add_argument("--seed", type=int, default=d.seed, help="Seeds the traffic (prompts, images, faults, sampling).")
    p.add_argument("--max-batch", type=int, default=d.max_batch, help="Started server: --max-batch.")
    p.add_argument("--max-seq-len", type=int, default=d.max_seq_len, help="Started server: --max-seq-len.")
    p.add_argument("--max-total-tokens", type=int, default=d.max_total_tokens, help="Started server: KV memory in tokens.")
    p.add_argument("--startup-timeout", type=float, default=d.startup_timeout_s, help="Seconds for the server to become healthy.")
    p.add_argument("--url", default=None, help="Drive this running server instead of starting one.")
    p.add_argument("--server-pid", type=int, default=None, help="With --url: the server's pid, for RSS samples.")
    p.add_argument("--model", default=None, help="Checkpoint directory (default: a tiny one built here).")
    p.add_argument("--workdir", default=None, help="Where the tiny model and the server log go (default: a temp dir).")
    p.add_argument("--json", dest="json_path", default=None, help="Also write the report here.")
    ns = p.parse_args(argv)
    try:
        return SoakOptions(
            clients=ns.clients, duration_s=ns.duration, warmup_s=ns.warmup, warmup_quiet_s=ns.warmup_quiet, max_turns=ns.max_turns,
            max_new_tokens=ns.max_new_tokens, image_fraction=ns.image_fraction, abort_fraction=ns.abort_fraction,
            drop_fraction=ns.drop_fraction, greedy_fraction=ns.greedy_fraction, greedy_tokens=ns.greedy_tokens,
            request_timeout_s=ns.request_timeout, settle_timeout_s=ns.settle_timeout, rss_interval_s=ns.rss_interval,
            rss_growth_bound_mib=ns.rss_growth_bound_mib, rss_drift_bound_mib=ns.rss_drift_bound_mib, seed=ns.seed, max_batch=ns.max_batch,
            max_seq_len=ns.max_seq_len, max_total_tokens=ns.max_total_tokens, startup_timeout_s=ns.startup_timeout,
            url=ns.url, server_pid=ns.server_pid, model=ns.model, workdir=ns.workdir, json_path=ns.json_path,
        )
    except ValueError as e:
        p.error(str(e))
        raise  # unreachable: p.error exits


# ------------------------------------------------------------------------------------------ outcomes


class RequestKind(enum.Enum):
    TEXT = "text"  # first turn, text only
    IMAGE = "image"  # first turn with an image
    CONTINUATION = "continuation"  # a later turn: the conversation so far plus an observation
    GREEDY_PROBE = "greedy_probe"


class Fault(enum.Enum):
    NONE = "none"
    ABORT = "abort"  # /abort_request by rid mid-generation
    DROP = "drop"  # the client closes the connection mid-request


class Outcome(enum.Enum):
    ANSWERED = "answered"  # finished by stop or length (an injected fault that came too late included)
    INJECTED_ABORT = "injected_abort"  # answered `abort` after our /abort_request
    INJECTED_DROP = "injected_drop"  # we closed the connection before the answer came
    # Unexpected:
    UNEXPECTED_ABORT = "unexpected_abort"  # `abort` with no fault injected
    REFUSED = "refused"  # HTTP 4xx
    UNAVAILABLE = "unavailable"  # connection error, HTTP 5xx or the request timeout
    BAD_ANSWER = "bad_answer"  # a 2xx that breaks the wire contract
    GREEDY_MISMATCH = "greedy_mismatch"  # a greedy probe answered differently from the quiet engine
    INJECTION_FAILED = "injection_failed"  # the /abort_request call itself failed


INJECTED = frozenset({Outcome.INJECTED_ABORT, Outcome.INJECTED_DROP})
UNEXPECTED = frozenset(set(Outcome) - INJECTED - {Outcome.ANSWERED})


@dataclass(frozen=True)
class RequestRecord:
    client: int
    kind: RequestKind
    fault: Fault
    outcome: Outcome
    sent_at_s: float  # since the load started
    latency_s: float
    detail: str = ""


# ------------------------------------------------------------------------------------------ traffic


def _test_image(rng: np.random.Generator, size: tuple[int, int]) -> Image.Image:
    """A blocky random RGB picture (blocks of 16 px, so it survives resizing as distinct content)."""
    w, h = size
    blocks = rng.integers(0, 256, size=(-(-h // 16), -(-w // 16), 3), dtype=np.uint8)
    return Image.fromarray(np.kron(blocks, np.ones((16, 16, 1), np.uint8))[:h, :w])


_WORDS = ("red", "blue", "square", "circle", "count", "left", "right", "above", "below", "sum", "seven", "twelve",
          "area", "angle", "line", "point", "triangle", "shade", "corner", "edge")


@dataclass(frozen=True)
class Segment:
    """One encoded prompt or observation: compact ids for the wire, its images, and its length once the
    server expands each image's pad."""

    wire_ids: tuple[int, ...]
    image_data: tuple[str, ...]
    expanded_len: int

    @classmethod
    def of(cls, seg: EncodedSegment) -> Segment:
        return cls(tuple(seg.wire_ids), tuple(seg.image_data), len(seg.train_ids))


@dataclass(frozen=True)
class Traffic:
    """The fixed pools every client draws from, encoded once: prompts (half with an image; shared across
    clients, so their prefixes meet in the radix cache), observations after a turn that ended with `<|im_end|>`
    and after one that did not, greedy probes, and the sampling params the rollout sends."""

    prompts: tuple[Segment, ...]
    image_prompts: tuple[int, ...]  # indices into prompts
    text_prompts: tuple[int, ...]
    observations_after_end: tuple[Segment, ...]
    observations_after_other: tuple[Segment, ...]
    probes: tuple[Segment, ...]
    sampling_params: dict[str, Any]
    im_end: int

    @classmethod
    def build(cls, encoder: ChatEncoder, seed: int, n_prompts: int = 12, n_observations: int = 6) -> Traffic:
        rng = np.random.default_rng(seed)
        images = [_test_image(rng, size) for size in ((64, 64), (96, 64), (64, 128), (128, 128), (128, 96), (80, 80))]

        def words(n: int) -> str:
            return " ".join(_WORDS[int(i)] for i in rng.integers(0, len(_WORDS), n))

        def user(text: str, image: Image.Image | None) -> dict[str, Any]:
            if image is None:
                return {"role": "user", "content": text}
            return {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}

        prompts, image_idx, text_idx = [], [], []
        for i in range(n_prompts):
            image = images[i % len(images)] if i % 2 == 0 else None
            (image_idx if image is not None else text_idx).append(i)
            system = {"role": "system", "content": "You solve geometry puzzles. " + words(int(rng.integers(4, 40)))}
            prompts.append(Segment.of(encoder.encode_prompt([system, user(f"Task {i}: {words(int(rng.integers(3, 30)))}?", image)])))
        after_end, after_other = [], []
        for i in range(n_observations):
            image = images[(i * 5 + 1) % len(images)] if i % 3 == 0 else None
            message = [user(f"Feedback {i}: {words(int(rng.integers(2, 15)))}.", image)]
            after_end.append(Segment.of(encoder.encode_observation(message, model_ended_turn=True)))
            after_other.append(Segment.of(encoder.encode_observation(message, model_ended_turn=False)))
        probes = (
            Segment.of(encoder.encode_prompt([user("Probe: " + words(12), None)])),
            Segment.of(encoder.encode_prompt([user("Probe: " + words(6), images[2])])),
            Segment.of(encoder.encode_prompt([user("Probe: " + words(20), images[3])])),
            prompts[1],  # a pool prompt: its prefix is cached under load
        )
        vision = encoder.vision
        params = default_sampling_params(RolloutOptions(), vision.banned_ids, vision.eos_ids)
        return cls(tuple(prompts), tuple(image_idx), tuple(text_idx), tuple(after_end), tuple(after_other), probes,
                   params, vision.im_end)

    def params(self, *, max_new_tokens: int, seed: int | None, greedy: bool = False) -> dict[str, Any]:
        out = dict(self.sampling_params, max_new_tokens=max_new_tokens)
        if greedy:
            out["temperature"] = 0.0
        else:
            out["temperature"] = 1.0
            out["sampling_seed"] = seed
        return out


# ------------------------------------------------------------------------------------------ server


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env() -> dict[str, str]:
    """This environment for the server child, with one simulated device (a test runner may set eight)."""
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def build_tiny_model(workdir: Path) -> Path:
    """`jaxrl-vlm make-tiny` into workdir/model (a subprocess: this process stays free of JAX)."""
    out = workdir / "model"
    proc = subprocess.run([sys.executable, "-m", "jaxrl_vlm.cli", "make-tiny", str(out)], env=_child_env(),
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SetupError(f"make-tiny {out} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return out


class ServerProcess:
    """`jaxrl-vlm serve` as a child process on a free loopback port, logging to `log`."""

    def __init__(self, model: Path, opts: SoakOptions, log: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        argv = [sys.executable, "-m", "jaxrl_vlm.cli", "serve", "--model", str(model), "--port", str(self.port),
                "--max-batch", str(opts.max_batch), "--max-seq-len", str(opts.max_seq_len),
                "--max-total-tokens", str(opts.max_total_tokens)]
        self.argv = argv
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(argv, env=_child_env(), stdout=out, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else "<no output>"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, then SIGKILL after `timeout_s`; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        return self.proc.returncode


# ------------------------------------------------------------------------------------------ measuring


def read_rss_mib(pid: int) -> float:
    """Resident memory of process `pid` in MiB (psutil where installed, else /proc/<pid>/status VmRSS)."""
    try:
        import psutil  # optional: only for the reading
    except ImportError:
        psutil = None
    if psutil is not None:
        try:
            return psutil.Process(pid).memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            raise ProcessLookupError(f"server process {pid} is gone") from None
    try:
        f = open(f"/proc/{pid}/status")
    except FileNotFoundError:
        raise ProcessLookupError(f"server process {pid} is gone") from None
    with f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"/proc/{pid}/status has no VmRSS line")


@dataclass(frozen=True)
class PageState:
    """`internal_states[0].kv_pages` of the engine's /get_server_info."""

    total: int
    free: int
    cached: int
    held_by_requests: int

    @classmethod
    def from_server_info(cls, info: dict[str, Any], endpoint: str) -> PageState:
        try:
            pages = info["internal_states"][0]["kv_pages"]
            return cls(int(pages["total"]), int(pages["free"]), int(pages["cached"]), int(pages["held_by_requests"]))
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise SetupError(f"{endpoint}: no internal_states[0].kv_pages ({type(e).__name__}: {e}); the page-leak check "
                             "needs jaxrl-vlm's embedded engine") from None


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100, linear interpolation), None for no values."""
    return float(np.percentile(np.asarray(values, np.float64), q)) if values else None


@dataclass
class SoakReport:
    options: dict[str, Any]
    server: dict[str, Any]
    duration_s: float = 0.0
    warmup_end_s: float | None = None
    sent: int = 0
    answered: int = 0
    by_outcome: dict[str, int] = field(default_factory=dict)
    by_kind: dict[str, int] = field(default_factory=dict)
    unexpected_failures: int = 0
    injected_faults: int = 0
    faults_too_late: dict[str, int] = field(default_factory=dict)  # injected, but the answer had come already
    failure_examples: list[str] = field(default_factory=list)
    latency_s: dict[str, float | None] = field(default_factory=dict)
    # (seconds since the load started, server RSS in MiB, programs the engine had compiled then or None)
    rss_mib: list[tuple[float, float, int | None]] = field(default_factory=list)
    rss_at_warmup_end_mib: float | None = None
    rss_end_mib: float | None = None
    rss_growth_after_warmup_mib: float | None = None
    rss_drift_between_compiles_mib: float | None = None  # over the second half of the load (or after warm-up)
    rss_drift_from_s: float | None = None
    programs_compiled_after_warmup: int | None = None
    # Their keys ("decode 8 128 False", ...): where each was compiled ("serving": where first needed, a stall of the
    # running requests; "side": on the engine's side thread, stalling nothing). Empty for an engine that does not say.
    programs_after_warmup: dict[str, str] = field(default_factory=dict)
    compiled_programs: dict[str, int | None] = field(default_factory=dict)
    pages_idle_baseline: dict[str, int] = field(default_factory=dict)
    pages_after_load: dict[str, int] = field(default_factory=dict)
    pages_after_flush: dict[str, int] = field(default_factory=dict)
    pages_held_after_load: int | None = None
    pages_leaked: int | None = None
    engine_stats: dict[str, Any] = field(default_factory=dict)
    greedy_probes_under_load: int = 0
    greedy_mismatches_under_load: int = 0
    greedy_equal_after_load: bool | None = None
    greedy_mismatch_details: list[str] = field(default_factory=list)
    server_exited: bool = False  # the server process went away during the run
    checks: dict[str, bool] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(self.checks.values())


# ------------------------------------------------------------------------------------------ the run


class Soak:
    """One soak run against `url`: quiet reference, load, settle, checks."""

    def __init__(self, opts: SoakOptions, url: str, model: Path, server_pid: int | None, server_desc: dict[str, Any]) -> None:
        self.opts = opts
        self.url = url
        self.server_pid = server_pid
        tokenizer = load_tokenizer(model)
        self.encoder = ChatEncoder(tokenizer, load_image_processor(model))
        self.traffic = Traffic.build(self.encoder, opts.seed)
        self.vocab_size = len(tokenizer)
        no_retry = RetryPolicy(max_retries=0)  # a retry would hide the failure this test looks for
        connections = 4 * opts.clients + 8
        self.client = SGLangClient(url, timeout_s=opts.request_timeout_s, retry=no_retry, max_connections=connections,
                                   vocab_size=self.vocab_size)
        self.dropper = SGLangClient(url, timeout_s=opts.request_timeout_s, retry=no_retry, max_connections=connections,
                                    vocab_size=self.vocab_size)
        self.records: list[RequestRecord] = []
        self.reference: dict[int, list[int]] = {}
        self.report = SoakReport(options=_jsonable(dataclasses.asdict(opts)), server=server_desc)
        self.t0 = 0.0
        self.warmup_end_s = opts.warmup_s
        self.programs_at_warmup_end: dict[str, str] = {}
        self.context_len = opts.max_seq_len
        self._rss_stop = asyncio.Event()

    # ---- engine state --------------------------------------------------------------------------

    async def server_info(self) -> dict[str, Any]:
        return await self.client.get_server_info()

    async def pages(self) -> PageState:
        return PageState.from_server_info(await self.server_info(), self.url + "/get_server_info")

    async def wait_idle(self, timeout_s: float) -> None:
        """Poll /v1/loads until nothing runs or waits; SetupError naming what is left at the deadline."""
        deadline = time.monotonic() + timeout_s
        busy = -1
        while time.monotonic() < deadline:
            loads = (await self.client.get_loads())["loads"]
            busy = sum(int(x["num_running_reqs"]) + int(x["num_waiting_reqs"]) for x in loads)
            if busy == 0:
                return
            await asyncio.sleep(0.2)
        raise SetupError(f"{self.url}/v1/loads: {busy} request(s) still running or waiting {timeout_s:g} s after the load")

    async def flush(self, timeout_s: float = 30.0) -> None:
        """/flush_cache, retried while the engine answers busy (bounded)."""
        deadline = time.monotonic() + timeout_s
        while not await self.client.flush_cache():
            if time.monotonic() > deadline:
                raise SetupError(f"{self.url}/flush_cache: still busy after {timeout_s:g} s")
            await asyncio.sleep(0.2)

    # ---- requests ------------------------------------------------------------------------------

    def _record(self, client: int, kind: RequestKind, fault: Fault, outcome: Outcome, sent: float, detail: str = "") -> None:
        self.records.append(RequestRecord(client, kind, fault, outcome, sent - self.t0, time.monotonic() - sent, detail))

    async def send(self, client: int, kind: RequestKind, fault: Fault, ids: Sequence[int], images: Sequence[str],
                   params: dict[str, Any], rng: random.Random) -> GenerateResult | None:
        """One /generate with `fault` injected; records its outcome; the result when it was answered normally."""
        rid = f"soak-{client}-{uuid.uuid4().hex}"  # unique: SGLang's abort matches rids by prefix
        sent = time.monotonic()
        delay = rng.uniform(*self.opts.fault_delay_s)
        try:
            if fault is Fault.DROP:
                # The client gives up after `delay`: aiohttp closes the connection, the server must abort.
                result = await self.dropper.generate(ids, image_data=images, sampling_params=params, rid=rid, timeout_s=delay)
            elif fault is Fault.ABORT:
                task = asyncio.create_task(self.client.generate(ids, image_data=images, sampling_params=params, rid=rid))
                done, _ = await asyncio.wait({task}, timeout=delay)
                if not done:
                    try:
                        await self.client.abort_request(rid=rid)
                    except (EngineUnavailable, EngineRequestError) as e:
                        self._record(client, kind, fault, Outcome.INJECTION_FAILED, sent, str(e))
                        task.cancel()
                        await asyncio.gather(task, return_exceptions=True)  # its outcome is this failure's
                        return None
                result = await task
            else:
                result = await self.client.generate(ids, image_data=images, sampling_params=params, rid=rid)
        except EngineUnavailable as e:
            timed_out = e.status is None and bool(e.errors) and all("timeout after" in err for err in e.errors)
            outcome = Outcome.INJECTED_DROP if fault is Fault.DROP and timed_out else Outcome.UNAVAILABLE
            self._record(client, kind, fault, outcome, sent, "" if outcome in INJECTED else str(e))
            return None
        except EngineRequestError as e:
            self._record(client, kind, fault, Outcome.REFUSED, sent, str(e))
            return None
        except EngineResponseError as e:
            self._record(client, kind, fault, Outcome.BAD_ANSWER, sent, str(e))
            return None
        if result.finish_reason is FinishType.ABORT:
            outcome = Outcome.INJECTED_ABORT if fault is Fault.ABORT else Outcome.UNEXPECTED_ABORT
            self._record(client, kind, fault, outcome, sent, "" if outcome in INJECTED else str(result.finish_message))
            return None
        self._record(client, kind, fault, Outcome.ANSWERED, sent)
        return result

    async def greedy(self, probe: int) -> list[int] | None:
        seg = self.traffic.probes[probe]
        params = self.traffic.params(max_new_tokens=self.opts.greedy_tokens, seed=None, greedy=True)
        result = await self.client.generate(seg.wire_ids, image_data=seg.image_data, sampling_params=params)
        return None if result.finish_reason is FinishType.ABORT else result.output_ids

    async def probe_under_load(self, client: int, rng: random.Random) -> None:
        probe = rng.randrange(len(self.traffic.probes))
        seg = self.traffic.probes[probe]
        params = self.traffic.params(max_new_tokens=self.opts.greedy_tokens, seed=None, greedy=True)
        result = await self.send(client, RequestKind.GREEDY_PROBE, Fault.NONE, seg.wire_ids, seg.image_data, params, rng)
        if result is None:
            return
        self.report.greedy_probes_under_load += 1
        if result.output_ids != self.reference[probe]:
            self.report.greedy_mismatches_under_load += 1
            detail = _difference(self.reference[probe], result.output_ids)
            self.report.greedy_mismatch_details.append(f"under load, probe {probe}: {detail}")
            self._record(client, RequestKind.GREEDY_PROBE, Fault.NONE, Outcome.GREEDY_MISMATCH, time.monotonic(), detail)

    def pick_fault(self, rng: random.Random) -> Fault:
        x = rng.random()
        if x < self.opts.abort_fraction:
            return Fault.ABORT
        if x < self.opts.abort_fraction + self.opts.drop_fraction:
            return Fault.DROP
        return Fault.NONE

    async def client_loop(self, client: int, deadline: float) -> None:
        """Episodes until `deadline` (and at most max_requests_per_client requests)."""
        rng = random.Random(self.opts.seed * 100_003 + client)
        t = self.traffic
        requests = 0
        while time.monotonic() < deadline and requests < self.opts.max_requests_per_client:
            if rng.random() < self.opts.greedy_fraction:
                requests += 1
                await self.probe_under_load(client, rng)
                continue
            pool = t.image_prompts if rng.random() < self.opts.image_fraction else t.text_prompts
            prompt = t.prompts[rng.choice(pool)]
            ids, images, length = list(prompt.wire_ids), list(prompt.image_data), prompt.expanded_len
            kind = RequestKind.IMAGE if images else RequestKind.TEXT
            for _turn in range(rng.randint(1, self.opts.max_turns)):
                if time.monotonic() >= deadline or length + self.opts.max_new_tokens >= self.context_len:
                    break
                requests += 1
                fault = self.pick_fault(rng)
                params = t.params(max_new_tokens=self.opts.max_new_tokens, seed=rng.randrange(2**31))
                if fault is not Fault.NONE:  # long enough for the fault to land mid-generation
                    params.update(max_new_tokens=min(self.opts.fault_max_new_tokens, self.context_len - length - 1),
                                  ignore_eos=True)
                result = await self.send(client, kind, fault, ids, images, params, rng)
                if result is None or fault is not Fault.NONE:
                    break
                ended = bool(result.output_ids) and result.output_ids[-1] == t.im_end
                obs = rng.choice(t.observations_after_end if ended else t.observations_after_other)
                ids += result.output_ids + list(obs.wire_ids)
                images += obs.image_data
                length += len(result.output_ids) + obs.expanded_len
                kind = RequestKind.CONTINUATION

    async def sample_rss(self) -> None:
        """RSS of the server every rss_interval_s until stopped."""
        if self.server_pid is None:
            return
        while not self._rss_stop.is_set():
            try:
                rss = read_rss_mib(self.server_pid)
            except ProcessLookupError:
                self.report.server_exited = True
                return
            try:
                programs = (await self.server_info())["internal_states"][0].get("num_compiled_programs")
            except EngineError:
                programs = None  # the clients record what the engine answers
            self.report.rss_mib.append((round(time.monotonic() - self.t0, 2), round(rss, 1), programs))
            try:
                await asyncio.wait_for(self._rss_stop.wait(), self.opts.rss_interval_s)
            except asyncio.TimeoutError:
                pass  # next sample

    # ---- phases --------------------------------------------------------------------------------

    async def run(self) -> SoakReport:
        opts, report = self.opts, self.report
        async with self.client, self.dropper:
            info = await self.server_info()
            self.context_len = int(info.get("context_length", opts.max_seq_len))
            # Idle baseline: with the cache flushed every page is free.
            await self.flush()
            report.pages_idle_baseline = dataclasses.asdict(await self.pages())
            # Quiet reference: each greedy probe alone (the first run of a shape compiles; run twice, keep the last
            # and require the two to agree: a quiet engine must be deterministic).
            for i in range(len(self.traffic.probes)):
                first, second = await self.greedy(i), await self.greedy(i)
                if first is None or second is None or first != second:
                    raise SetupError(f"greedy probe {i} on the quiet engine: {first} then {second}")
                self.reference[i] = second
            info = await self.server_info()
            report.compiled_programs["before_load"] = info["internal_states"][0].get("num_compiled_programs")

            self.t0 = time.monotonic()
            rss_task = asyncio.create_task(self.sample_rss())
            deadline = self.t0 + opts.duration_s
            clients = [asyncio.create_task(self.client_loop(i, deadline)) for i in range(opts.clients)]
            warm = asyncio.create_task(self._note_warmup_end())
            await asyncio.wait_for(asyncio.gather(*clients), opts.duration_s + opts.request_timeout_s + 30)
            report.duration_s = round(time.monotonic() - self.t0, 1)
            await warm

            await self.wait_idle(opts.settle_timeout_s)
            after = []
            for i in range(len(self.traffic.probes)):
                out = await self.greedy(i)
                if out != self.reference[i]:
                    report.greedy_mismatch_details.append(f"after load, probe {i}: {_difference(self.reference[i], out or [])}")
                after.append(out == self.reference[i])
            report.greedy_equal_after_load = all(after)
            await self.wait_idle(opts.settle_timeout_s)
            pages = await self.pages()
            report.pages_after_load = dataclasses.asdict(pages)
            report.pages_held_after_load = pages.held_by_requests
            info = await self.server_info()
            report.compiled_programs["end"] = info["internal_states"][0].get("num_compiled_programs")
            report.programs_after_warmup = new_programs(self.programs_at_warmup_end, program_keys(info))
            report.engine_stats = info["internal_states"][0].get("engine_stats", {})
            await self.flush()
            flushed = await self.pages()
            report.pages_after_flush = dataclasses.asdict(flushed)
            report.pages_leaked = flushed.total - flushed.free
            self._rss_stop.set()
            await rss_task
        self.summarize()
        return report

    async def _note_warmup_end(self) -> None:
        """Warm-up ends `warmup_s` into the load, or later while the engine still compiles programs for new shapes
        (each adds to its RSS once): once the program count held for `warmup_quiet_s`, at the latest halfway
        through the load."""
        opts = self.opts
        await asyncio.sleep(opts.warmup_s)
        latest = self.t0 + max(opts.warmup_s, opts.duration_s / 2)
        programs, since = None, time.monotonic()
        while True:
            info = await self.server_info()
            now = time.monotonic()
            count = info["internal_states"][0].get("num_compiled_programs")
            if count != programs:
                programs, since = count, now
            if now - since >= opts.warmup_quiet_s or now >= latest:
                break
            await asyncio.sleep(1.0)
        self.warmup_end_s = round(now - self.t0, 2)
        self.report.warmup_end_s = self.warmup_end_s
        self.report.compiled_programs["warmup_end"] = programs
        self.programs_at_warmup_end = program_keys(info)

    def summarize(self) -> None:
        opts, report = self.opts, self.report
        recs = self.records
        report.sent = len([r for r in recs if r.outcome is not Outcome.GREEDY_MISMATCH])  # a mismatch is a 2nd record
        report.answered = sum(r.outcome is Outcome.ANSWERED for r in recs)
        report.by_outcome = {o.value: sum(r.outcome is o for r in recs) for o in Outcome}
        report.by_kind = {k.value: sum(r.kind is k and r.outcome is not Outcome.GREEDY_MISMATCH for r in recs) for k in RequestKind}
        report.unexpected_failures = sum(r.outcome in UNEXPECTED for r in recs)
        report.injected_faults = sum(r.outcome in INJECTED for r in recs)
        report.faults_too_late = {f.value: sum(r.fault is f and r.outcome is Outcome.ANSWERED for r in recs)
                                  for f in (Fault.ABORT, Fault.DROP)}
        report.failure_examples = [f"{r.outcome.value} ({r.kind.value}, fault {r.fault.value}): {r.detail}"
                                   for r in recs if r.outcome in UNEXPECTED][:10]
        answered = [r for r in recs if r.outcome is Outcome.ANSWERED and r.fault is Fault.NONE
                    and r.kind is not RequestKind.GREEDY_PROBE]
        warm = [r.latency_s for r in answered if r.sent_at_s >= self.warmup_end_s]
        every = [r.latency_s for r in answered]
        report.latency_s = {"p50": _round(percentile(warm, 50)), "p99": _round(percentile(warm, 99)),
                            "max": _round(max(warm) if warm else None), "p99_with_warmup": _round(percentile(every, 99))}
        samples = report.rss_mib
        if samples:
            post = [x for x in samples if x[0] >= self.warmup_end_s]
            report.rss_end_mib = samples[-1][1]
            if post:
                report.rss_at_warmup_end_mib = post[0][1]
                last_quarter_from = post[0][0] + 0.75 * (post[-1][0] - post[0][0])
                report.rss_growth_after_warmup_mib = round(
                    max(m for t, m, _ in post if t >= last_quarter_from) - post[0][1], 1)
                # A first-time path (a new batch mix, a long retraction) still adds a few MiB once some time after
                # warm-up; a leak keeps adding: judge the second half of the load.
                report.rss_drift_from_s = max(self.warmup_end_s, report.duration_s / 2)
                report.rss_drift_between_compiles_mib = rss_drift_between_compiles(samples, report.rss_drift_from_s)
                if post[0][2] is not None and post[-1][2] is not None:
                    report.programs_compiled_after_warmup = post[-1][2] - post[0][2]
        report.checks = {
            "no_unexpected_failures": report.unexpected_failures == 0,
            "no_pages_held_after_load": report.pages_held_after_load == 0,
            "no_pages_leaked": report.pages_leaked == 0,
            "greedy_equal_under_load": report.greedy_mismatches_under_load == 0,
            "greedy_equal_after_load": bool(report.greedy_equal_after_load),
            "traffic_reached_every_kind": all(report.by_kind[k.value] > 0 for k in RequestKind)
                                          and report.by_outcome[Outcome.INJECTED_ABORT.value] > 0
                                          and report.by_outcome[Outcome.INJECTED_DROP.value] > 0,
        }
        if self.server_pid is not None:
            report.checks["server_alive_after_load"] = not report.server_exited
            growth = report.rss_growth_after_warmup_mib
            report.checks["rss_growth_within_bound"] = growth is not None and growth <= opts.rss_growth_bound_mib
            drift = report.rss_drift_between_compiles_mib
            report.checks["rss_drift_within_bound"] = drift is not None and drift <= opts.rss_drift_bound_mib


def program_keys(info: dict[str, Any]) -> dict[str, str]:
    """The embedded engine's compiled programs in a `/get_server_info` answer: key (joined) -> "side" or "serving"
    (where it was compiled); empty for a server that does not list them."""
    listed = info.get("internal_states", [{}])[0].get("compiled_programs", [])
    return {" ".join(map(str, p["key"])): "side" if p["side_thread"] else "serving" for p in listed}


def new_programs(before: dict[str, str], after: dict[str, str]) -> dict[str, str]:
    return {key: where for key, where in after.items() if key not in before}


# RSS keeps growing for some seconds after a program compiled (a 300 s run: +10 MiB at once, then +4 MiB over the next
# 7 s, then < 1 MiB a minute): the intervals this long after a compilation belong to it.
COMPILE_LAG_S = 12.0


def rss_drift_between_compiles(samples: Sequence[tuple[float, float, int | None]], since_s: float) -> float | None:
    """RSS growth (MiB) summed over the sample intervals ending at or after `since_s` that no compilation can
    explain: those whose program count held from COMPILE_LAG_S before the interval to its end. A leak shows here;
    the one-off growth of a new program does not. None without two such samples or counts."""
    if sum(t >= since_s for t, _, _ in samples) < 2 or any(p is None for _, _, p in samples):
        return None
    drift = 0.0
    for i in range(1, len(samples)):
        if samples[i][0] < since_s:
            continue
        first = next(j for j in range(i + 1) if samples[j][0] >= samples[i][0] - COMPILE_LAG_S)
        window = [p for _, _, p in samples[max(0, first - 1) : i + 1]]
        if len(set(window)) == 1:
            drift += samples[i][1] - samples[i - 1][1]
    return round(drift, 1)


def _difference(expected: Sequence[int], got: Sequence[int]) -> str:
    first = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
    return f"first difference at token {first}: expected {list(expected)}, got {list(got)}"


def _round(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


def _jsonable(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def format_report(report: SoakReport) -> str:
    """The human table printed at the end."""
    lines = [f"soak: {report.options['clients']} clients, {report.duration_s:g} s of load against {report.server.get('url')}"]
    rows = [("requests sent", report.sent), ("answered", report.answered),
            ("injected faults (answered abort / dropped)", f"{report.by_outcome['injected_abort']} / {report.by_outcome['injected_drop']}"),
            ("faults that came after the answer (abort / drop)", f"{report.faults_too_late['abort']} / {report.faults_too_late['drop']}"),
            ("unexpected failures", report.unexpected_failures)]
    rows += [(f"  {o.value}", report.by_outcome[o.value]) for o in Outcome if o in UNEXPECTED and report.by_outcome[o.value]]
    rows += [("requests by kind", ", ".join(f"{k} {n}" for k, n in report.by_kind.items())),
             ("latency after warm-up p50 / p99 / max (s)",
              f"{report.latency_s['p50']} / {report.latency_s['p99']} / {report.latency_s['max']}"),
             ("latency p99 with warm-up (compiles) (s)", report.latency_s["p99_with_warmup"]),
             ("warm-up ended at (s)", report.warmup_end_s),
             ("server RSS at warm-up end / end (MiB)", f"{report.rss_at_warmup_end_mib} / {report.rss_end_mib}"),
             ("RSS growth after warm-up (MiB)", f"{report.rss_growth_after_warmup_mib} (bound {report.options['rss_growth_bound_mib']:g}), "
              f"{report.programs_compiled_after_warmup} programs compiled since"),
             (f"RSS drift between compilations from {report.rss_drift_from_s} s (MiB)",
              f"{report.rss_drift_between_compiles_mib} (bound {report.options['rss_drift_bound_mib']:g})"),
             ("compiled programs (before / warm-up end / end)",
              f"{report.compiled_programs.get('before_load')} / {report.compiled_programs.get('warmup_end')} / {report.compiled_programs.get('end')}"),
             ("programs compiled after warm-up (where)",
              ", ".join(f"{key} ({where})" for key, where in report.programs_after_warmup.items()) or "none listed"),
             ("KV pages idle baseline", _pages(report.pages_idle_baseline)),
             ("KV pages after load (settled)", _pages(report.pages_after_load)),
             ("KV pages after flush", _pages(report.pages_after_flush)),
             ("pages held by requests after load / leaked", f"{report.pages_held_after_load} / {report.pages_leaked}"),
             ("greedy probes under load (mismatches)", f"{report.greedy_probes_under_load} ({report.greedy_mismatches_under_load})"),
             ("greedy equal after load", report.greedy_equal_after_load),
             ("engine: aborted / retractions / evictions / prefix hits",
              " / ".join(str(report.engine_stats.get(k)) for k in ("aborted", "retractions", "prefix_evictions", "prefix_hits")))]
    width = max(len(name) for name, _ in rows)
    lines += [f"  {name:<{width}}  {value}" for name, value in rows]
    lines += [f"  check {name}: {'ok' if ok else 'FAILED'}" for name, ok in report.checks.items()]
    lines += [f"  failure: {x}" for x in report.failure_examples]
    lines += [f"  greedy: {x}" for x in report.greedy_mismatch_details[:5]]
    if report.rss_mib:
        step = max(1, len(report.rss_mib) // 12)
        lines.append("  RSS over time (s: MiB, programs): "
                     + ", ".join(f"{t:g}: {m:g} ({p})" for t, m, p in report.rss_mib[::step]))
    lines.append(f"soak {'PASSED' if report.passed else 'FAILED'}")
    return "\n".join(lines)


def _pages(p: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in p.items()) if p else "n/a"


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_options(argv)
    workdir = Path(opts.workdir or tempfile.mkdtemp(prefix="jaxrl-vlm-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    server: ServerProcess | None = None
    try:
        model = Path(opts.model) if opts.model else build_tiny_model(workdir)
        if not (model / "config.json").is_file():
            raise SetupError(f"--model {model}: no config.json there")
        if opts.url is None:
            server = ServerProcess(model, opts, workdir / "serve.log")
            url, pid = server.url, server.pid
            desc = {"url": url, "pid": pid, "argv": server.argv[1:], "log": str(server.log)}
        else:
            url, pid = opts.url.rstrip("/"), opts.server_pid
            desc = {"url": url, "pid": pid}
        report = asyncio.run(_run(opts, url, model, pid, desc, server))
    except (SetupError, EngineError) as e:  # an engine that stops answering control calls ends the run here
        print(f"soak: {'setup' if isinstance(e, SetupError) else 'engine'} failed: {e}", file=sys.stderr)
        if server is not None:
            print(f"--- server log tail ({server.log}) ---\n{server.log_tail()}", file=sys.stderr)
        return 2
    finally:
        if server is not None:
            rc = server.stop()
            print(f"soak: server stopped (exit {rc}), log {server.log}", file=sys.stderr)
    print(format_report(report))
    body = _jsonable(dataclasses.asdict(report)) | {"passed": report.passed}
    print("SOAK_JSON " + json.dumps({k: v for k, v in body.items() if k != "rss_mib"}, sort_keys=True))
    if opts.json_path:
        Path(opts.json_path).write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
    return 0 if report.passed else 1


async def _run(opts: SoakOptions, url: str, model: Path, pid: int | None, desc: dict[str, Any],
               server: ServerProcess | None) -> SoakReport:
    probe = SGLangClient(url, retry=RetryPolicy(max_retries=0))
    async with probe:
        deadline = time.monotonic() + opts.startup_timeout_s
        while not await probe.health():
            if server is not None and server.proc.poll() is not None:
                raise SetupError(f"the server exited with {server.proc.returncode} before it was healthy")
            if time.monotonic() > deadline:
                raise SetupError(f"{url} not healthy within {opts.startup_timeout_s:g} s")
            await asyncio.sleep(1.0)
    return await Soak(opts, url, model, pid, desc).run()


if __name__ == "__main__":
    sys.exit(main())
