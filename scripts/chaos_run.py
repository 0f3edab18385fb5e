"""Chaos run: the main job for M minutes of wall time while faults keep arriving, then an account of every sample.

    python scripts/chaos_run.py [--minutes 60] [--seed 0] [--workdir DIR] [--json report.json]
    python scripts/chaos_run.py --minutes 60 --no-faults          # the fault-free comparison run
    python scripts/chaos_run.py --minutes 60 --compare-with clean.json
    python scripts/chaos_run.py --report-from WORKDIR [--earlier its.json] [--no-faults] [--json r.json]  # again
    python scripts/chaos_run.py --compare chaos.json clean.json                       # two reports' eval curves

What runs (issue 49 item 3): `jaxrl-vlm train configs/color_reveal_tiny.yaml` in async mode (`--max-staleness 1`)
against an external `jaxrl-vlm serve` engine, reached through a small TCP proxy of this script (so connections can
be dropped), with periodic checkpoints, weight exports on a small tmpfs (mounted here when root may mount one), every
step's episodes dumped (trained and FAILED ones), and the env wrapped by `scripts/chaos_env.py` (faults on order).

Faults, one at a time: each is injected, then waited for until recovered (or `--recovery-timeout`), then the next
follows after a random gap. The first ones run through every kind in a seeded order, later ones are drawn at
random (seeded); each is logged with its time since the start (`chaos t=...`):

* engine_kill: `kill -9` of the engine while it has requests, then a restart on the same port. Recovered: a step
  trained after the restart, and the engine reports the trainer's weight version.
* trainer_sigterm: SIGTERM of the trainer while its rollout has requests in the engine (exit 0 expected), then a
  resume with `--load`. Recovered: a step trained by the resumed trainer.
* env_hang / env_raise: one episode's env hangs / raises on every step (scripts/chaos_env.py). Recovered: that
  episode is in a step's dump as FAILED (env_error: its retries timed out or raised), and a step trained after it.
* dropped_connection: the proxy resets every connection between trainer and engine while requests run.
  Recovered: a step trained after it.
* disk_full: the export directory (tmpfs) is filled up; the next weight export fails with ENOSPC, which stops the
  trainer (exit 1, by design: a version that cannot be written is not published), then the space is freed and the
  run resumed with `--load`. Recovered: a step trained after that.
* corrupt_picture: one training row (seeded) carries a truncated PNG from the start; `--on-bad-row skip` drops it
  at load with a warning naming the row. Recovered: that warning, and a step trained. (A dataset row is read once,
  when a trainer starts, so this fault is in the data before the run, not switched on later; the fault-free run
  reads the same file, so both runs see the same prompts in the same order.)

At the end the trainer is stopped with SIGTERM (its preemption checkpoint holds the groups still in the stream),
and the report gives:

* the sample ledger: every sample of every group the run started (`next_group_index` of the last checkpoint x
  n_samples_per_prompt) is trained (in a step's dump), FAILED with a typed cause (in a step's dump), in a group
  dropped whole by a counted reason (the step records, or the last checkpoint's `dropped_groups` for groups dropped
  after the last batch), or carried in the last checkpoint's stream state. The
  others are the "samples unaccounted". The dumps and records are those of the chain of runs (a resumed run's
  lines replace what an interrupted run logged after its checkpoint);
* failures by cause, steps trained, the recovery time of each fault, step time before and after each fault;
* the engine's KV pages at the end (`/get_server_info`, after `/flush_cache`): leaked = total - free;
* RSS and open file descriptors of trainer and engine every `--sample-interval` seconds; per process lifetime
  (each restart is a new one) the growth after its warm-up (RSS judged over `--rss-window-min` seconds or more);
* the eval curve (`eval/heldout/raw_reward`), and with `--compare-with` the fault-free run's at the same steps and
  whether the two agree within noise once the learning rate has decayed (`--lr-decay-steps`);
* the raw RSS/fd series (`resource_series` of the --json report).

The last line is `chaos: F faults injected, R recovered, U samples unaccounted`. Exit status 0 only when every
fault recovered, no sample is unaccounted, no page leaked and the RSS/fd growth is within the bounds.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import io
import json
import math
import os
import random
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(SCRIPTS))

from soak_engine import PageState, read_rss_mib  # noqa: E402  (scripts/ is on the path above)

CONFIG = "configs/color_reveal_tiny.yaml"
EVAL_KEY = "eval/heldout/raw_reward"


def eval_series(chain: list[dict]) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(step, eval reward) of every eval, and (step, its sampling standard error: the episodes' reward std over
    the square root of their count)."""
    evals = [(int(r["step"]), round(float(r[EVAL_KEY]), 4)) for r in chain if EVAL_KEY in r]
    ses = [(int(r["step"]), round(float(r[EVAL_KEY + "_std"]) / math.sqrt(float(r["eval/heldout/samples"])), 5))
           for r in chain if EVAL_KEY in r and EVAL_KEY + "_std" in r and r.get("eval/heldout/samples")]
    return evals, ses
FAULT_KINDS = ("engine_kill", "trainer_sigterm", "env_hang", "env_raise", "dropped_connection", "disk_full")
PER_SAMPLE_DROPS = ("failed_sample", "aborted_sample", "no_reward_sample")


def jsonl_lines(path: Path) -> list[str]:
    """The lines of a JSONL file, split at "\n" only: `str.splitlines` also splits at U+2028, U+0085 and the like,
    which a dump holds raw inside strings (a random model's text, written with ensure_ascii=False)."""
    return [ln for ln in path.read_text(encoding="utf-8").split("\n") if ln]


def log(t0: float, msg: str) -> None:
    print(f"chaos t={time.monotonic() - t0:7.1f}s {msg}", flush=True)


# ------------------------------------------------------------------------------------------ options
@dataclass(frozen=True)
class ChaosOptions:
    minutes: float = 60.0
    seed: int = 0
    workdir: Path | None = None
    faults: bool = True
    json_path: Path | None = None
    compare_with: Path | None = None
    mean_gap_s: float = 30.0  # mean random gap between one fault's recovery and the next injection
    recovery_timeout_s: float = 420.0
    sample_interval_s: float = 5.0
    warmup_s: float = 150.0  # a process's warm-up (compilations) before its RSS/fd growth is judged
    rss_growth_bound_mib: float = 256.0
    # RSS growth is judged over at least this long after warm-up: over a shorter window the allocator settling after
    # the last compilations reads as growth (a 3-minute run's last trainer grew 283 MiB in the 45 s after a 60 s warm-up).
    rss_window_min_s: float = 300.0
    fd_growth_bound: int = 32
    eval_interval: int = 10
    # The config's cosine decay (3e-3 to 3e-4) over this many steps, then 3e-4: a run bounded by wall time has no
    # --num-rollout to decay over, and a constant 3e-3 keeps the policy swinging, which hides how faults change it.
    lr_decay_steps: int = 300
    initial_eval: bool = True
    eval_rows: int = 32
    save_interval: int = 5
    export_tmpfs_mib: int = 16
    keep: bool = False


def parse_options(argv: list[str] | None = None) -> ChaosOptions:
    d = ChaosOptions()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=d.minutes, help="Wall time of the faulted training (default 60).")
    p.add_argument("--seed", type=int, default=d.seed, help="Seed of the fault schedule and of the corrupt row.")
    p.add_argument("--workdir", type=Path, default=None, help="Where everything goes (default: a new temp dir).")
    p.add_argument("--no-faults", action="store_true", help="The same run without faults (the comparison).")
    p.add_argument("--json", type=Path, default=None, help="Also write the report here.")
    p.add_argument("--compare-with", type=Path, default=None, help="A fault-free run's --json report.")
    p.add_argument("--mean-gap", type=float, default=d.mean_gap_s, help="Mean seconds between faults.")
    p.add_argument("--recovery-timeout", type=float, default=d.recovery_timeout_s)
    p.add_argument("--sample-interval", type=float, default=d.sample_interval_s, help="Seconds between RSS/fd samples.")
    p.add_argument("--warmup", type=float, default=d.warmup_s, help="Seconds of a process's warm-up.")
    p.add_argument("--rss-growth-bound-mib", type=float, default=d.rss_growth_bound_mib)
    p.add_argument("--rss-window-min", type=float, default=d.rss_window_min_s,
                   help="Seconds after warm-up a process must live before its RSS growth is judged (fds: 8 samples).")
    p.add_argument("--fd-growth-bound", type=int, default=d.fd_growth_bound)
    p.add_argument("--eval-interval", type=int, default=d.eval_interval)
    p.add_argument("--lr-decay-steps", type=int, default=d.lr_decay_steps,
                   help="Steps of the learning rate's decay to --min-lr, then held (the eval is compared after them).")
    p.add_argument("--no-initial-eval", action="store_true", help="No eval before the first step (shorter start).")
    p.add_argument("--keep", action="store_true", help="Keep the workdir (always kept when --workdir is given).")
    ns = p.parse_args(argv)
    if ns.minutes <= 0:
        p.error("--minutes must be > 0")
    return ChaosOptions(minutes=ns.minutes, seed=ns.seed, workdir=ns.workdir, faults=not ns.no_faults,
                        json_path=ns.json, compare_with=ns.compare_with, mean_gap_s=ns.mean_gap,
                        recovery_timeout_s=ns.recovery_timeout, sample_interval_s=ns.sample_interval,
                        warmup_s=ns.warmup, rss_growth_bound_mib=ns.rss_growth_bound_mib,
                        rss_window_min_s=ns.rss_window_min,
                        fd_growth_bound=ns.fd_growth_bound, eval_interval=ns.eval_interval,
                        lr_decay_steps=ns.lr_decay_steps, keep=ns.keep,
                        initial_eval=not ns.no_initial_eval)


# ------------------------------------------------------------------------------------------ small helpers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 5.0) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return json.load(answer)
    except (OSError, ValueError):
        return None


def answers(url: str, timeout: float = 2.0) -> bool:
    """The URL answers 200 (SGLang's /health has an empty body)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return answer.status == 200
    except OSError:
        return False


def post_json(url: str, body: dict | None = None, timeout: float = 30.0) -> tuple[int, dict | None]:
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as e:
        return e.code, None
    except (OSError, ValueError):
        return 0, None


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def child_env(control: Path) -> dict[str, str]:
    """One CPU device per process (a test runner may set eight), this tree's code and the chaos env first."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join([str(SCRIPTS), str(REPO)]),
           "JAXRL_CHAOS_DIR": str(control), "HF_HUB_OFFLINE": "1"}
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join([*flags, "--xla_force_host_platform_device_count=1"])
    return env


def tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except FileNotFoundError:
        return ""


# ------------------------------------------------------------------------------------------ the TCP proxy
class DropProxy:
    """127.0.0.1:listen_port -> 127.0.0.1:target_port, one pair of pump threads per connection. `drop_all` resets
    every open connection (SO_LINGER 0: the peers see ECONNRESET, as when a NAT or load balancer drops them)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.lock = threading.Lock()
        self.pairs: set[tuple[socket.socket, socket.socket]] = set()
        self.closed = False
        threading.Thread(target=self._accept, daemon=True, name="proxy-accept").start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
                upstream.settimeout(None)
            except OSError:
                self._reset(client)  # engine down: the client sees a reset, as without the proxy
                continue
            pair = (client, upstream)
            with self.lock:
                self.pairs.add(pair)
            threading.Thread(target=self._pump, args=(pair,), daemon=True, name="proxy-pump").start()

    def _pump(self, pair: tuple[socket.socket, socket.socket]) -> None:
        a, b = pair
        try:
            while True:
                ready, _, _ = select.select([a, b], [], [], 1.0)
                if self.closed:
                    return
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        return
                    (b if s is a else a).sendall(data)
        except (OSError, ValueError):
            return
        finally:
            with self.lock:
                self.pairs.discard(pair)
            for s in pair:
                with contextlib.suppress(OSError):
                    s.close()

    @staticmethod
    def _reset(s: socket.socket) -> None:
        with contextlib.suppress(OSError):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            s.close()

    def drop_all(self) -> int:
        with self.lock:
            pairs = list(self.pairs)
            self.pairs.clear()
        for a, b in pairs:
            self._reset(a)
            self._reset(b)
        return len(pairs)

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.server.close()
        self.drop_all()


# ------------------------------------------------------------------------------------------ processes
class Engine:
    """`jaxrl-vlm serve` on a fixed port; each start is a new incarnation."""

    def __init__(self, model: Path, port: int, log_path: Path, env: dict[str, str]) -> None:
        self.model, self.port, self.log_path, self.env = model, port, log_path, env
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.incarnation = 0

    def start(self, timeout_s: float = 300.0) -> float:
        """Start and wait until /health answers; returns the seconds it took."""
        t = time.monotonic()
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jaxrl_vlm.cli", "serve", "--model", str(self.model), "--port", str(self.port),
                 "--max-batch", "64", "--max-seq-len", "256"],
                cwd=REPO, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        self.incarnation += 1
        while not answers(self.url + "/health"):
            if self.proc.poll() is not None or time.monotonic() - t > timeout_s:
                raise RuntimeError(f"jaxrl-vlm serve did not come up on {self.url}:\n{tail(self.log_path)}")
            time.sleep(0.2)
        return time.monotonic() - t

    def busy(self) -> int:
        loads = get_json(self.url + "/v1/loads?include=core", timeout=2)
        if not loads:
            return 0
        return sum(int(r.get("num_running_reqs", 0)) + int(r.get("num_waiting_reqs", 0)) for r in loads.get("loads", []))

    def weight_version(self) -> int | None:
        info = get_json(self.url + "/model_info", timeout=5)
        try:
            return int(info["weight_version"]) if info else None
        except (KeyError, TypeError, ValueError):
            return None

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=60)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


class Trainer:
    """`jaxrl-vlm train` of the chain: the first start fresh, every later one with `--load`."""

    def __init__(self, argv: list[str], out: Path, log_path: Path, env: dict[str, str]) -> None:
        self.argv, self.out, self.log_path, self.env = argv, out, log_path, env
        self.proc: subprocess.Popen | None = None
        self.incarnation = 0
        self.exits: list[dict[str, Any]] = []

    def start(self) -> None:
        argv = list(self.argv)
        if self.incarnation > 0:
            argv += ["--load", str(self.out / "checkpoints")]
        with open(self.log_path, "ab") as out:
            out.write(f"\n===== chaos: trainer start {self.incarnation} =====\n".encode())
            out.flush()
            self.proc = subprocess.Popen(argv, cwd=REPO, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        self.incarnation += 1

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait(self, timeout_s: float) -> int | None:
        assert self.proc is not None
        try:
            rc = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
        self.exits.append({"incarnation": self.incarnation - 1, "rc": rc})
        return rc


# ------------------------------------------------------------------------------------------ metrics.jsonl
class Records:
    """Training-step records of the chain, and a counter of step lines ever appended (a resumed run's lines
    replace an interrupted run's, so the file's count can fall; `appended` never does)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.appended = 0
        self._lines = 0
        self._last_evals = 0

    def poll(self) -> int:
        try:
            lines = jsonl_lines(self.path)
        except FileNotFoundError:
            return self.appended
        n = sum(1 for ln in lines if '"rollout/samples"' in ln)
        if n > self._lines:
            self.appended += n - self._lines
        self._lines = n
        return self.appended

    def chain(self) -> list[dict]:
        from jaxrl_vlm.job.run_log import read_metrics

        return read_metrics(self.path) if self.path.exists() else []


# ------------------------------------------------------------------------------------------ resources
@dataclass
class ResourceSeries:
    """(t, rss_mib, fds) per process incarnation, e.g. ("trainer", 2)."""

    samples: dict[str, list[tuple[float, float, int]]] = field(default_factory=lambda: defaultdict(list))

    def add(self, key: str, t: float, pid: int) -> None:
        try:
            self.samples[key].append((round(t, 1), round(read_rss_mib(pid), 1), open_fds(pid)))
        except (ProcessLookupError, FileNotFoundError, PermissionError, RuntimeError):
            pass

    def growth(self, warmup_s: float, first_step_after: Callable[[float], float | None],
               rss_window_min_s: float) -> dict[str, dict[str, Any]]:
        """Per incarnation: its warm-up ends `warmup_s` after the first step the run trained once it had started
        (start-up and the first compilations are no leak). After it, the drift: the median of the last quarter of
        the samples minus the median of the first quarter (a leak drifts; a spike, e.g. files a checkpoint opens for
        a moment, does not), and the maximum; open files by the quarters' maxima. Judged only with 8 samples or more
        after warm-up, RSS only over `rss_window_min_s` or more (`rss_judged`)."""
        out = {}
        for key, series in self.samples.items():
            if not series:
                continue
            start = series[0][0]
            first = first_step_after(start)
            warm_end = None if first is None else first + warmup_s
            after = [s for s in series if warm_end is not None and s[0] >= warm_end]
            entry: dict[str, Any] = {"samples": len(series), "lifetime_s": round(series[-1][0] - start, 1),
                                     "rss_first_mib": series[0][1], "rss_last_mib": series[-1][1],
                                     "fds_first": series[0][2], "fds_last": series[-1][2],
                                     "rss_max_mib": max(s[1] for s in series), "fds_max": max(s[2] for s in series)}
            if len(after) >= 8:
                q = max(1, len(after) // 4)
                head, tail_ = after[:q], after[-q:]
                entry["judged"] = True
                entry["rss_judged"] = after[-1][0] - after[0][0] >= rss_window_min_s
                entry["warmup_end_s"] = round(warm_end, 1)
                entry["rss_at_warmup_end_mib"] = after[0][1]
                entry["rss_growth_after_warmup_mib"] = round(statistics.median(s[1] for s in tail_)
                                                             - statistics.median(s[1] for s in head), 1)
                entry["rss_max_after_warmup_mib"] = max(s[1] for s in after)
                entry["fds_at_warmup_end"] = after[0][2]
                # fds: the last quarter's maximum against every earlier sample of the lifetime (warm-up included).
                # Engine and trainer hold one per client connection, which an engine kill or a dropped connection
                # takes away for a while and the client's pool then refills to a level seen before; a leak rises
                # above every earlier level.
                earlier = series[: len(series) - len(tail_)]
                entry["fd_growth_after_warmup"] = max(s[2] for s in tail_) - max(s[2] for s in earlier)
                entry["fds_max_after_warmup"] = max(s[2] for s in after)
            else:
                entry["judged"] = entry["rss_judged"] = False
            out[key] = entry
        return out


# ------------------------------------------------------------------------------------------ faults
@dataclass
class FaultRecord:
    number: int
    kind: str
    injected_at_s: float
    detail: str = ""
    recovered: bool = False
    recovery_s: float | None = None
    weight_version_trainer: int | None = None
    weight_version_engine: int | None = None
    step_time_before_s: float | None = None
    step_time_after_s: float | None = None
    note: str = ""
    injected_epoch: float = 0.0
    recovered_epoch: float | None = None


class Chaos:
    def __init__(self, opts: ChaosOptions, work: Path) -> None:
        self.opts = opts
        self.work = work
        self.rng = random.Random(opts.seed)
        self.t0 = time.monotonic()
        self.t0_epoch = time.time()  # the same instant on the epoch clock (metrics.jsonl's "time")
        self.control = work / "control"
        self.control.mkdir(parents=True, exist_ok=True)
        self.out = work / "run"
        self.sync_dir = work / "export"
        self.env = child_env(self.control)
        self.faults: list[FaultRecord] = []
        self.resources = ResourceSeries()
        self.records = Records(self.out / "metrics.jsonl")
        self.tmpfs = False
        self.disk_equivalent = ""
        self.env_fault_ids = 0
        self._stop_sampling = threading.Event()
        self.corrupt_row: int | None = None

    def say(self, msg: str) -> None:
        log(self.t0, msg)

    # ---- setup
    def prepare(self) -> tuple[Path, Path, Path]:
        """The tiny model, the training prompts (one row's picture truncated) and the eval prompts."""
        model, train, heldout = self.work / "tiny", self.work / "train.parquet", self.work / "heldout.parquet"
        code = ("import sys; from jaxrl_vlm.config import load_config; from jaxrl_vlm.job.assets import prepare_assets; "
                "prepare_assets(load_config(sys.argv[1], ['--hf-checkpoint', sys.argv[2], '--prompt-data', sys.argv[3], "
                "'--eval-prompt-data', 'heldout', sys.argv[4]]))")
        clean = self.work / "train_clean.parquet"
        subprocess.run([sys.executable, "-c", code, CONFIG, str(model), str(clean), str(heldout)], cwd=REPO,
                       env=self.env, check=True, capture_output=True, timeout=600)
        self.corrupt_row = corrupt_one_picture(clean, train, random.Random(self.opts.seed + 7))
        return model, train, heldout

    def mount_export_dir(self) -> None:
        """A small tmpfs for the weight exports, so a full disk is a real ENOSPC. Without the right to mount
        (not root), the export dir stays on the work disk and `disk_full` makes it read-only instead (EACCES at the
        same write: the same failure path, another errno)."""
        self.sync_dir.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.opts.export_tmpfs_mib}m", "tmpfs",
                                   str(self.sync_dir)], capture_output=True, text=True)
            self.tmpfs = done.returncode == 0
            if not self.tmpfs:
                self.disk_equivalent = f"mount failed ({done.stderr.strip()}): a read-only export dir instead"
        else:
            self.disk_equivalent = "not root: a read-only export dir instead of a full tmpfs"
        self.say(f"export dir {self.sync_dir}: " + (f"tmpfs of {self.opts.export_tmpfs_mib} MiB" if self.tmpfs
                                                    else self.disk_equivalent))

    def unmount(self) -> None:
        if self.tmpfs:
            subprocess.run(["umount", "-l", str(self.sync_dir)], capture_output=True)

    def trainer_argv(self, model: Path, train: Path, heldout: Path, proxy_port: int) -> list[str]:
        return [sys.executable, "-m", "jaxrl_vlm.cli", "train", CONFIG,
                "--hf-checkpoint", str(model), "--prompt-data", str(train), "--on-bad-row", "skip",
                "--eval-prompt-data", "heldout", f"{heldout}@[0:{self.opts.eval_rows}]",
                "--eval-interval", str(self.opts.eval_interval),
                "--skip-eval-before-train", "false" if self.opts.initial_eval else "true",
                "--engine-url", f"http://127.0.0.1:{proxy_port}", "--engine-reconnect-timeout", "300",
                "--episode-timeout", "600", "--env-step-timeout", "5",
                "--max-staleness", "1", "--num-rollout", "1000000", "--lr-decay-iters", str(self.opts.lr_decay_steps),
                "--output-dir", str(self.out),
                "--save-interval", str(self.opts.save_interval), "--keep-checkpoints", "2",
                "--weight-sync-dir", str(self.sync_dir), "--preemption-grace-seconds", "120",
                "--rollout-interaction-env-path", "chaos_env",
                "--dump-rollout-interval", "1", "--dump-rollout-max-samples", "100000"]

    def sample_resources(self, engine: Engine, trainer: Trainer) -> None:
        while not self._stop_sampling.wait(self.opts.sample_interval_s):
            t = time.monotonic() - self.t0
            if engine.proc is not None and engine.proc.poll() is None:
                self.resources.add(f"engine#{engine.incarnation}", t, engine.proc.pid)
            if trainer.alive():
                self.resources.add(f"trainer#{trainer.incarnation}", t, trainer.proc.pid)

    # ---- waiting
    def wait_until(self, what: str, predicate: Callable[[], bool], timeout_s: float, trainer: Trainer | None = None,
                   poll_s: float = 0.2) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return True
            if trainer is not None and not trainer.alive():
                self.say(f"the trainer exited ({trainer.proc.returncode}) while waiting for {what}")
                return False
            time.sleep(poll_s)
        self.say(f"{what}: not within {timeout_s:g} s")
        return False

    def wait_steps(self, n: int, trainer: Trainer, timeout_s: float) -> bool:
        target = self.records.poll() + n
        return self.wait_until(f"{n} more trained step(s)", lambda: self.records.poll() >= target, timeout_s, trainer)

    def step_time(self, records: list[dict], last: int = 5) -> float | None:
        times = [r["perf/step_time"] for r in records if "perf/step_time" in r][-last:]
        return round(statistics.median(times), 3) if times else None

    # ---- the faults
    def inject(self, kind: str, engine: Engine, trainer: Trainer, proxy: DropProxy) -> FaultRecord:
        f = FaultRecord(len(self.faults) + 1, kind, round(time.monotonic() - self.t0, 1), injected_epoch=time.time())
        self.faults.append(f)
        t_inject = time.monotonic()
        timeout = self.opts.recovery_timeout_s
        if kind in ("engine_kill", "trainer_sigterm", "dropped_connection"):
            # mid-rollout: while the engine has requests (bounded: a step may be training meanwhile)
            self.wait_until("requests in the engine", lambda: engine.busy() > 0, 120, trainer, poll_s=0.05)
            t_inject = time.monotonic()
            f.injected_at_s = round(t_inject - self.t0, 1)
            f.injected_epoch = time.time()
        if kind == "engine_kill":
            engine.kill9()
            self.say(f"fault #{f.number} engine_kill injected: kill -9 of engine pid (incarnation {engine.incarnation})")
            time.sleep(2.0)  # the outage: the trainer must hold its requests meanwhile
            up = engine.start()
            f.detail = f"engine restarted in {up:.1f} s"
            ok = self.wait_steps(1, trainer, timeout)
            ok = ok and self.confirm_version(f, engine)
        elif kind == "trainer_sigterm":
            trainer.proc.send_signal(signal.SIGTERM)
            self.say(f"fault #{f.number} trainer_sigterm injected (trainer incarnation {trainer.incarnation - 1})")
            rc = trainer.wait(300)
            if rc is None:
                f.note = "the trainer did not exit within 300 s of SIGTERM; SIGKILLed"
                trainer.proc.kill()
                trainer.wait(60)
            f.detail = f"trainer exited {rc}; resumed with --load"
            trainer.start()
            ok = rc == 0 and self.wait_steps(1, trainer, timeout) and self.confirm_version(f, engine)
        elif kind in ("env_hang", "env_raise"):
            self.env_fault_ids += 1
            fid = self.env_fault_ids
            order = self.control / "env_fault.json.tmp"
            order.write_text(json.dumps({"id": fid, "kind": kind.removeprefix("env_")}))
            order.rename(self.control / "env_fault.json")
            self.say(f"fault #{f.number} {kind} injected (order {fid})")
            claimed = self.control / f"env_fault_{fid}.claimed"
            ok = self.wait_until("an episode claimed the env fault", claimed.exists, timeout, trainer)
            if ok:
                where = json.loads(claimed.read_text())
                g, i = where["group_index"], where["index"]
                cause = "env_error"  # a step that hangs past --env-step-timeout is retried like an error
                f.detail = f"episode (group {g}, sample {i})"
                status: dict[str, Any] = {}

                def failed_in_dump() -> bool:
                    rec = find_in_dumps(self.out / "rollout", g, i, since=where["time"] - 1)
                    if rec is not None:
                        status.update(rec)
                    return rec is not None and rec.get("status") == "failed"

                ok = self.wait_until(f"sample ({g}, {i}) FAILED in a dump", failed_in_dump, timeout, trainer, poll_s=1.0)
                if ok:
                    errors = " ".join(map(str, status.get("errors") or [status.get("error")]))
                    f.detail += f" FAILED as {status.get('termination')}" + (" (step timed out)" if "timed out" in errors else "")
                    if status.get("termination") != cause:
                        f.note = f"expected termination {cause}, got {status.get('termination')}"
                ok = ok and self.wait_steps(1, trainer, timeout) and self.confirm_version(f, engine)
        elif kind == "dropped_connection":
            n = proxy.drop_all()
            self.say(f"fault #{f.number} dropped_connection injected: {n} connections reset")
            f.detail = f"{n} connections reset"
            ok = self.wait_steps(1, trainer, timeout) and self.confirm_version(f, engine)
        elif kind == "disk_full":
            ok = self.disk_full(f, trainer, engine, timeout)
        else:
            raise ValueError(kind)
        if ok:
            f.recovered = True
            f.recovery_s = round(time.monotonic() - t_inject, 1)
            f.recovered_epoch = time.time()
            self.say(f"fault #{f.number} {kind} recovered in {f.recovery_s:.1f} s ({f.detail})"
                     + (f"; weight version {f.weight_version_engine} confirmed" if f.weight_version_engine is not None else ""))
        else:
            self.say(f"fault #{f.number} {kind} NOT recovered ({f.detail} {f.note})")
        return f

    def confirm_version(self, f: FaultRecord, engine: Engine) -> bool:
        """The engine serves the trainer's weight version (or a later one, pushed meanwhile)."""
        def check() -> bool:
            chain = self.records.chain()
            trained = [r for r in chain if "rollout/samples" in r]
            f.weight_version_trainer = int(trained[-1]["weight_version"]) if trained else None
            f.weight_version_engine = engine.weight_version()
            return (f.weight_version_trainer is not None and f.weight_version_engine is not None
                    and f.weight_version_engine >= f.weight_version_trainer)
        return self.wait_until("the engine reports the trainer's weight version", check, 120, poll_s=0.5)

    def disk_full(self, f: FaultRecord, trainer: Trainer, engine: Engine, timeout: float) -> bool:
        filler = self.sync_dir / "chaos_filler"
        if self.tmpfs:
            with open(filler, "wb", buffering=0) as out:  # unbuffered: nothing left to flush at close
                chunk = b"\0" * (1 << 16)
                with contextlib.suppress(OSError):
                    while True:
                        out.write(chunk)
            free = shutil.disk_usage(self.sync_dir).free
            self.say(f"fault #{f.number} disk_full injected: export tmpfs filled ({free} bytes free)")
        else:
            for p in [self.sync_dir, *self.sync_dir.rglob("*")]:
                if p.is_dir():
                    p.chmod(0o555)
            self.say(f"fault #{f.number} disk_full injected: export dir made read-only ({self.disk_equivalent})")
        # The next export fails; the trainer stops (or, if it ever learns to wait, keeps going: both end here).
        before = self.records.poll()
        stopped = self.wait_until("the trainer stopped on the failed export", lambda: not trainer.alive()
                                  or self.records.poll() >= before + 3, 180)
        rc = trainer.wait(1) if not trainer.alive() else None
        text = tail(trainer.log_path, 20000)
        if filler.exists():
            filler.unlink()
        for p in [self.sync_dir, *self.sync_dir.rglob("*")]:
            if p.is_dir():
                p.chmod(0o755)
        if rc is not None:
            why = "ENOSPC" if "No space left on device" in text else ("EACCES" if "Permission denied" in text else "?")
            f.detail = f"trainer exited {rc} on the failed export ({why}); space freed, resumed with --load"
            if rc == 0 or why == "?":
                f.note = f"unexpected trainer exit {rc}: {text[-600:]}"
            trainer.start()
        else:
            f.detail = "the trainer kept training with the export dir full" if stopped else "no effect seen"
        ok = self.wait_steps(1, trainer, timeout) and self.confirm_version(f, engine)
        return ok and not f.note

    # ---- the run
    def run(self) -> dict[str, Any]:
        model, train, heldout = self.prepare()
        self.say(f"assets ready under {self.work} (row {self.corrupt_row} of the training data has a corrupt picture)")
        self.mount_export_dir()
        engine_port = free_port()
        engine = Engine(model, engine_port, self.work / "engine.log", self.env)
        up = engine.start()
        self.say(f"engine up at {engine.url} in {up:.1f} s")
        proxy = DropProxy(engine_port)
        trainer = Trainer(self.trainer_argv(model, train, heldout, proxy.port), self.out, self.work / "trainer.log",
                          self.env)
        sampler = threading.Thread(target=self.sample_resources, args=(engine, trainer), daemon=True)
        sampler.start()
        start = time.monotonic()
        trainer.start()
        self.say(f"trainer started (proxy 127.0.0.1:{proxy.port} -> engine {engine_port}); "
                 f"{'faults on' if self.opts.faults else 'no faults'} for {self.opts.minutes:g} min after its first step")
        unexpected: list[str] = []
        deadline = start + 60 * self.opts.minutes
        try:
            # The clock starts at the first trained step: start-up (imports, first compilations, the first eval)
            # takes minutes on a busy 2-core machine and is no time under fault.
            first = self.wait_steps(1, trainer, 1800)
            deadline = time.monotonic() + 60 * self.opts.minutes
            self.say(f"first step trained {time.monotonic() - start:.0f} s after the start; the {self.opts.minutes:g} "
                     "minutes start now")
            if self.opts.faults:
                f = FaultRecord(1, "corrupt_picture", 0.0, detail=f"training row {self.corrupt_row}: truncated PNG")
                self.faults.append(f)
                skipped = f"row {self.corrupt_row}:" in tail(trainer.log_path, 10**6)
                f.recovered = first and skipped
                f.recovery_s = round(time.monotonic() - start, 1) if f.recovered else None
                f.recovered_epoch = time.time() if f.recovered else None
                self.say(f"fault #1 corrupt_picture {'recovered' if f.recovered else 'NOT recovered'}: the loader "
                         f"{'skipped' if skipped else 'did not report'} row {self.corrupt_row}, first step trained")
                order = list(FAULT_KINDS)
                self.rng.shuffle(order)
                while time.monotonic() < deadline - 20:
                    if not trainer.alive():
                        unexpected.append(f"trainer exited {trainer.proc.returncode} outside a fault")
                        self.say(unexpected[-1] + "; resuming")
                        trainer.wait(1)
                        trainer.start()
                        self.wait_steps(1, trainer, self.opts.recovery_timeout_s)
                        continue
                    gap = min(self.rng.expovariate(1 / self.opts.mean_gap_s), 3 * self.opts.mean_gap_s)
                    if time.monotonic() + gap > deadline - 20:
                        break
                    time.sleep(gap)
                    kind = order.pop(0) if order else self.rng.choice(FAULT_KINDS)
                    self.inject(kind, engine, trainer, proxy)
            while time.monotonic() < deadline:
                if not trainer.alive():
                    unexpected.append(f"trainer exited {trainer.proc.returncode} outside a fault")
                    self.say(unexpected[-1] + "; resuming")
                    trainer.wait(1)
                    trainer.start()
                time.sleep(1.0)
            # The end: SIGTERM, so the last checkpoint holds the stream's groups.
            self.say("time is up: SIGTERM to the trainer")
            trainer.proc.send_signal(signal.SIGTERM)
            rc = trainer.wait(600)
            if rc != 0:
                unexpected.append(f"the final stop exited {rc}")
            pages = self.page_check(engine)
        finally:
            self._stop_sampling.set()
            if trainer.alive():
                trainer.proc.kill()
                trainer.wait(60)
            engine.stop()
            proxy.close()
            self.unmount()
        return self.report(pages, unexpected, time.monotonic() - start)

    def page_check(self, engine: Engine) -> dict[str, Any]:
        """The engine's KV pages once idle and after /flush_cache: leaked = total - free after the flush."""
        url = engine.url + "/get_server_info"
        self.wait_until("the engine idle", lambda: engine.busy() == 0, 60)
        before = PageState.from_server_info(get_json(url) or {}, url)
        for _ in range(50):  # SGLang answers 400 while requests are still being torn down
            code, _ = post_json(engine.url + "/flush_cache")
            if code == 200:
                break
            time.sleep(0.2)
        after = PageState.from_server_info(get_json(url) or {}, url)
        return {"after_run": dataclasses.asdict(before), "after_flush": dataclasses.asdict(after),
                "held_by_requests": before.held_by_requests, "leaked": after.total - after.free}

    # ---- the report
    def report(self, pages: dict[str, Any], unexpected: list[str], wall_s: float) -> dict[str, Any]:
        chain = self.records.chain()
        steps = [r for r in chain if "rollout/samples" in r]
        ledger = sample_ledger(self.out, steps)
        every = [json.loads(ln) for ln in jsonl_lines(self.records.path)] if self.records.path.exists() else []
        timed = [(r["time"], r["perf/step_time"]) for r in every if "perf/step_time" in r and "time" in r]
        for f in self.faults:  # median step time of the 5 steps logged before the fault and the 5 after its recovery
            before = [st for t, st in timed if t < f.injected_epoch][-5:]
            after = [st for t, st in timed if f.recovered_epoch is not None and t > f.recovered_epoch][:5]
            f.step_time_before_s = round(statistics.median(before), 2) if before else None
            f.step_time_after_s = round(statistics.median(after), 2) if after else None
        step_times = sorted(t - self.t0_epoch for t, _ in timed)

        def first_step_after(t: float) -> float | None:
            return next((x for x in step_times if x > t), None)

        resources = self.resources.growth(self.opts.warmup_s, first_step_after, self.opts.rss_window_min_s)
        evals, eval_se = eval_series(chain)
        report: dict[str, Any] = {
            "minutes": self.opts.minutes, "seed": self.opts.seed, "faults_on": self.opts.faults,
            "wall_s": round(wall_s, 1), "workdir": str(self.work), "t0_epoch": self.t0_epoch,
            "export_dir": "tmpfs" if self.tmpfs else self.disk_equivalent,
            "steps_trained": len(steps), "last_step": int(steps[-1]["step"]) if steps else None,
            "trainer_starts": None, "unexpected": unexpected,
            "faults": [dataclasses.asdict(f) for f in self.faults],
            "ledger": ledger, "pages": pages, "resources": resources, "eval_curve": evals, "eval_sampling_se": eval_se,
            "lr_decay_steps": self.opts.lr_decay_steps,
            "resource_series": {k: [list(x) for x in v] for k, v in self.resources.samples.items()},
            "step_time_median_s": self.step_time(steps, last=10**9),
            "bounds": {"rss_growth_after_warmup_mib": self.opts.rss_growth_bound_mib,
                       "fd_growth_after_warmup": self.opts.fd_growth_bound, "warmup_s": self.opts.warmup_s,
                       "rss_window_min_s": self.opts.rss_window_min_s,
                       "recovery_timeout_s": self.opts.recovery_timeout_s},
        }
        if self.opts.compare_with is not None:
            report["comparison"] = compare_evals(report, json.loads(self.opts.compare_with.read_text()),
                                                 self.opts.lr_decay_steps)
        return report


# ------------------------------------------------------------------------------------------ data faults
def corrupt_one_picture(clean: Path, out: Path, rng: random.Random) -> int:
    """Copy `clean` to `out` with one row's (seeded) picture truncated to half its PNG bytes; returns the row."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(clean)
    row = rng.randrange(table.num_rows)
    images = table.column("images").to_pylist()
    png = images[row][0]["bytes"]
    images[row] = [{"bytes": png[: len(png) // 2], "path": images[row][0].get("path")}]
    table = table.set_column(table.schema.get_field_index("images"), "images",
                             pa.array(images, type=table.schema.field("images").type))
    pq.write_table(table, out)
    return row


def find_in_dumps(rollout_dir: Path, group: int, index: int, since: float) -> dict | None:
    """The dump record of sample (group, index) in a step dump written after `since` (epoch seconds)."""
    if not rollout_dir.exists():
        return None
    for path in rollout_dir.glob("step_*.jsonl"):
        if path.stat().st_mtime < since:
            continue
        with contextlib.suppress(OSError):
            for line in jsonl_lines(path):
                if f'"group_index": {group},' in line or f'"group_index": {group}' in line:
                    rec = json.loads(line)
                    if rec.get("group_index") == group and rec.get("index") == index:
                        return rec
    return None


# ------------------------------------------------------------------------------------------ the ledger
def sample_ledger(out: Path, steps: list[dict]) -> dict[str, Any]:
    """Every sample of every group the chain started, by what became of it (module docstring)."""
    ckpts = sorted((int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()), reverse=True) \
        if (out / "checkpoints").exists() else []
    if not ckpts:
        return {"error": "no checkpoint", "unaccounted": None}
    meta = json.loads((out / "checkpoints" / str(ckpts[0]) / "meta" / "metadata").read_text())
    state = meta["driver_state"]
    started_groups = int(state["next_group_index"])
    final_step = ckpts[0]  # the steps 0..final_step-1 are the chain's
    fate: dict[tuple[int, int], str] = {}
    double: list[tuple[int, int]] = []
    causes: Counter[str] = Counter()
    for step in range(final_step):
        path = out / "rollout" / f"step_{step}.jsonl"
        if not path.exists():
            continue
        for line in jsonl_lines(path):
            rec = json.loads(line)
            key = (int(rec["group_index"]), int(rec["index"]))
            what = "trained" if rec["status"] != "failed" else f"failed:{rec.get('termination')}"
            if key in fate:
                double.append(key)
            fate[key] = what
            if what != "trained":
                causes[what] += 1
    n = int(meta["config"]["rollout"]["n_samples_per_prompt"])
    for rec in state.get("unreported", {}).get("failed", []):  # FAILED after the last batch, dumped by a resume
        key = (int(rec["group_index"]), int(rec["index"]))
        if key not in fate:
            fate[key] = "failed_after_last_batch"
            causes["failed_after_last_batch"] += 1
    carried = 0
    for group in state.get("partial_groups", []):  # the whole group is in the checkpoint (finished or to restart)
        g = int(group["group_index"])
        for i in range(n):
            if (g, i) not in fate:
                fate[(g, i)] = "carried_in_last_checkpoint"
                carried += 1
    whole_group_drops: Counter[str] = Counter()
    chain_steps = [r for r in steps if int(r["step"]) < final_step]
    for r in chain_steps:
        for k, v in r.items():
            if k.startswith("rollout/dynamic_filter/drop_") and k.removeprefix("rollout/dynamic_filter/drop_") \
                    not in PER_SAMPLE_DROPS and k != "rollout/dynamic_filter/drop_empty_group":
                whole_group_drops[k.removeprefix("rollout/dynamic_filter/drop_")] += int(v)
    # Groups dropped whole after the last batch the chain trained: the last checkpoint names them (the resumed run
    # would have counted them with its first batch).
    dropped_pending = {int(d["group_index"]): d["reason"] for d in state.get("dropped_groups", [])}
    dropped_after = 0
    for g in dropped_pending:
        for i in range(n):
            if (g, i) not in fate:
                fate[(g, i)] = "in_group_dropped_after_last_batch"
                dropped_after += 1
    groups_seen = {g for g, _ in fate}
    absent_groups = [g for g in range(started_groups) if g not in groups_seen]
    # A group dropped whole (a stale group, a filter) trains none of its samples; its FAILED ones were dumped before
    # the drop. So the groups with samples neither trained, FAILED nor carried must be exactly the counted drops.
    partial = {g: [i for i in range(n) if (g, i) not in fate] for g in groups_seen if g < started_groups}
    partial = {g: missing for g, missing in partial.items() if missing}
    incomplete = len(absent_groups) + len(partial)
    missing_samples = n * len(absent_groups) + sum(map(len, partial.values()))
    beyond = [k for k in fate if k[0] >= started_groups]
    dropped_whole = sum(whole_group_drops.values())
    in_dropped_groups = missing_samples if incomplete <= dropped_whole else 0
    unaccounted = (missing_samples - in_dropped_groups) + len(double) + len(beyond)
    trained = sum(1 for v in fate.values() if v == "trained")
    return {
        "last_checkpoint_step": final_step, "groups_started": started_groups, "n_samples_per_prompt": n,
        "samples_started": started_groups * n, "samples_trained": trained,
        "samples_failed_by_cause": dict(causes), "samples_carried_in_last_checkpoint": carried,
        "groups_dropped_whole_by_reason": dict(whole_group_drops), "samples_in_groups_dropped_whole": in_dropped_groups,
        "groups_dropped_after_last_batch": sorted(dropped_pending),
        "samples_in_groups_dropped_after_last_batch": dropped_after,
        "groups_incomplete": incomplete, "samples_incomplete": sorted(partial.items())[:10],
        "samples_seen_twice": double[:20],
        "samples_beyond_started_groups": beyond[:20], "unaccounted": unaccounted,
        "steps_in_chain": len(chain_steps),
    }


def compare_evals(run: dict[str, Any], clean: dict[str, Any], settled_from: int = 0) -> dict[str, Any]:
    """Eval reward of a run and of the fault-free one (two reports) at their common steps, and over the settled part
    (steps >= `settled_from`, the end of the learning rate's decay) whether the two means are within noise:
    |difference| <= 2 standard errors of the difference. Each run's error has two parts: the spread of its settled
    evals over their count (the policy's wander) and the sampling error of one eval (its episodes' reward std over
    the square root of their count), not divided by the count, since every eval draws the same prompts and seeds
    (a converged policy's evals are identical)."""
    other = dict((int(s), float(v)) for s, v in clean.get("eval_curve", []))
    common = [(s, v, other[s]) for s, v in run.get("eval_curve", []) if s in other]
    diffs = [v - w for _, v, w in common]
    out: dict[str, Any] = {
        "common_steps": [s for s, _, _ in common], "chaos": [v for _, v, _ in common],
        "fault_free": [w for _, _, w in common], "mean_diff": round(statistics.mean(diffs), 4) if diffs else None,
        "max_abs_diff": round(max(map(abs, diffs)), 4) if diffs else None}
    steps = [s for s, _, _ in common if s >= settled_from]
    if len(steps) >= 3:
        a, b = [v for s, v, _ in common if s >= settled_from], [w for s, _, w in common if s >= settled_from]

        def sampling_se(report: dict[str, Any]) -> float:
            ses = [float(se) for s, se in report.get("eval_sampling_se", []) if int(s) in steps]
            return statistics.mean(ses) if ses else 0.0

        se_a = math.sqrt(statistics.variance(a) / len(a) + sampling_se(run) ** 2)
        se_b = math.sqrt(statistics.variance(b) / len(b) + sampling_se(clean) ** 2)
        two_se = 2 * math.sqrt(se_a**2 + se_b**2)
        diff = statistics.mean(a) - statistics.mean(b)
        out["settled"] = {"from_step": settled_from, "evals": len(steps), "chaos_mean": round(statistics.mean(a), 4),
                          "fault_free_mean": round(statistics.mean(b), 4), "diff": round(diff, 4),
                          "chaos_eval_sampling_se": round(sampling_se(run), 5),
                          "fault_free_eval_sampling_se": round(sampling_se(clean), 5),
                          "two_se": round(two_se, 4), "within_noise": abs(diff) <= two_se}
    return out


# ------------------------------------------------------------------------------------------ printing
def verdict(report: dict[str, Any], opts: ChaosOptions) -> tuple[int, int, int | None, list[str]]:
    faults = report["faults"]
    f = len(faults)
    r = sum(1 for x in faults if x["recovered"])
    u = report["ledger"].get("unaccounted")
    problems = []
    if r != f:
        problems.append(f"{f - r} fault(s) not recovered")
    if u != 0:
        problems.append(f"samples unaccounted: {u}")
    if report["pages"].get("leaked") != 0 or report["pages"].get("held_by_requests") != 0:
        problems.append(f"KV pages: {report['pages']}")
    for key, g in report["resources"].items():
        if g.get("judged") and ((g["rss_judged"] and g["rss_growth_after_warmup_mib"] > opts.rss_growth_bound_mib)
                                or g["fd_growth_after_warmup"] > opts.fd_growth_bound):
            problems.append(f"{key}: RSS +{g['rss_growth_after_warmup_mib']} MiB, fds +{g['fd_growth_after_warmup']}"
                            " after warm-up")
    if report["unexpected"]:
        problems.append("; ".join(report["unexpected"]))
    return f, r, u, problems


def print_report(report: dict[str, Any], opts: ChaosOptions) -> int:
    print("\n==== chaos report ====")
    print(f"wall {report['wall_s']:.0f} s, {report['steps_trained']} steps trained (chain), median step time "
          f"{report['step_time_median_s']} s, export dir: {report['export_dir']}")
    print("faults:")
    for x in report["faults"]:
        print(f"  #{x['number']:<3} t={x['injected_at_s']:7.1f}s {x['kind']:<19} "
              f"{'recovered in %6.1f s' % x['recovery_s'] if x['recovered'] else 'NOT RECOVERED        '}  "
              f"step time {x['step_time_before_s']} -> {x['step_time_after_s']} s  "
              f"weights trainer/engine {x['weight_version_trainer']}/{x['weight_version_engine']}  {x['detail']} {x['note']}")
    by_kind: dict[str, list[float]] = defaultdict(list)
    for x in report["faults"]:
        if x["recovery_s"] is not None:
            by_kind[x["kind"]].append(x["recovery_s"])
    for kind, times in sorted(by_kind.items()):
        print(f"  recovery {kind}: {len(times)} x, max {max(times):.1f} s, median {statistics.median(times):.1f} s")
    led = report["ledger"]
    print(f"ledger: {json.dumps(led)}")
    print(f"KV pages: {json.dumps(report['pages'])}")
    print("RSS/fds per process lifetime (growth judged after a warm-up of "
          f"{opts.warmup_s:g} s; bounds +{opts.rss_growth_bound_mib:g} MiB, +{opts.fd_growth_bound} fds):")
    for key, g in sorted(report["resources"].items()):
        rss = "" if g.get("rss_judged") else f" (RSS not judged: under {opts.rss_window_min_s:g} s after warm-up)"
        judged = (f"after warm-up RSS +{g['rss_growth_after_warmup_mib']} MiB, fds +{g['fd_growth_after_warmup']}{rss}"
                  if g["judged"] else "not judged (short-lived)")
        print(f"  {key:<12} {g['lifetime_s']:7.0f} s  RSS {g['rss_first_mib']}->{g['rss_last_mib']} MiB "
              f"(max {g['rss_max_mib']})  fds {g['fds_first']}->{g['fds_last']} (max {g['fds_max']})  {judged}")
    print(f"eval curve ({EVAL_KEY}): {report['eval_curve']}")
    if "comparison" in report:
        print(f"vs fault-free: {json.dumps(report['comparison'])}")
    f, r, u, problems = verdict(report, opts)
    for p in problems:
        print(f"PROBLEM: {p}")
    print(f"chaos: {f} faults injected, {r} recovered, {u} samples unaccounted", flush=True)
    return 0 if not problems else 1


def with_eval_se(report: dict[str, Any]) -> dict[str, Any]:
    """A report with its evals' sampling errors, read from the run's metrics when the report predates them."""
    metrics = Path(report.get("workdir", "")) / "run" / "metrics.jsonl"
    if "eval_sampling_se" not in report and metrics.is_file():
        report["eval_sampling_se"] = eval_series(Records(metrics).chain())[1]
    return report


def report_from(work: Path, opts: ChaosOptions, earlier: Path | None = None) -> int:
    """The report of a run that has finished, rebuilt from its workdir (metrics, dumps, checkpoints): for a run
    whose own report failed, or (with `earlier`, its first report) judged again by this script's rules. What only
    the live run measured (faults, RSS/fd series, KV pages) comes from `earlier`, or is absent."""
    chaos = Chaos(opts, work.resolve())
    pages: dict[str, Any] = {"rebuilt": "not measured (report rebuilt from the run's files)"}
    unexpected = ["rebuilt from files: no faults, RSS/fd series or KV pages"]
    wall = 0.0
    if earlier is not None:
        old = json.loads(earlier.read_text())
        chaos.faults = [FaultRecord(**f) for f in old["faults"]]
        chaos.resources.samples.update({k: [tuple(x) for x in v] for k, v in old["resource_series"].items()})
        if "t0_epoch" in old:
            chaos.t0_epoch = old["t0_epoch"]
        else:  # reports before t0_epoch was kept: the two clocks of a fault injected while running give it
            timed = [f for f in chaos.faults if f.injected_epoch > 0]
            if timed:
                chaos.t0_epoch = statistics.median(f.injected_epoch - f.injected_at_s for f in timed)
        pages, unexpected, wall = old["pages"], old["unexpected"], old["wall_s"]
    report = chaos.report(pages, unexpected, wall_s=wall)
    if opts.json_path is not None:
        opts.json_path.write_text(json.dumps(report, indent=1))
    return print_report(report, opts)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--report-from"]:  # --report-from WORKDIR [--earlier REPORT.json] [options]: rebuilt from files
        rest = args[2:]
        earlier = None
        if rest[:1] == ["--earlier"]:
            earlier, rest = Path(rest[1]), rest[2:]
        return report_from(Path(args[1]), parse_options(rest), earlier)
    if args[:1] == ["--compare"]:  # --compare CHAOS.json FAULT_FREE.json: the eval curves side by side
        chaos, clean = (with_eval_se(json.loads(Path(a).read_text())) for a in args[1:3])
        print(json.dumps(compare_evals(chaos, clean, chaos.get("lr_decay_steps", 0)), indent=1))
        return 0
    opts = parse_options(argv)
    work = opts.workdir or Path(tempfile.mkdtemp(prefix="chaos_"))
    work.mkdir(parents=True, exist_ok=True)
    chaos = Chaos(opts, work.resolve())
    report = chaos.run()
    if opts.json_path is not None:
        opts.json_path.write_text(json.dumps(report, indent=1))
    rc = print_report(report, opts)
    if opts.workdir is None and not opts.keep and rc == 0:
        shutil.rmtree(work, ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
