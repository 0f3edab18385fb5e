"""Minimal reproduction of issue 49 item 1: two threads launching collective programs on shared CPU devices.

    python scripts/repro_collective_stall.py [--case train+tp4] [--seconds 120] [--guard]
    python scripts/repro_collective_stall.py --all [--seconds 90]     # every case, each in its own process

Each case runs in a process with 8 simulated CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8) and
two threads, shaped like the product's two device users:

* the trainer thread: a jitted step over a Mesh of all 8 devices (`data` axis), its state donated, the batch
  sharded and the weights replicated, so the gradient is an all-reduce; dispatched asynchronously (no
  block_until_ready) for `--ahead` steps before it waits, as the job's loop may;
* the engine thread: the embedded engine's shape of program on its placement, its cache donated, and a
  `device_get` of a small result every step, as the scheduler does. `--case` picks the placement:
  `train+tp1` (device 0 alone: no collective), `train+tp2` / `train+tp4` (devices 0-1 / 0-3, tensor-parallel:
  an all-reduce), `train+tp8` (the trainer's 8 devices, another program and its own all-reduce),
  `train+disjoint` (tp4 on devices 4-7 with the trainer on 0-3: nothing shared).

A watchdog stops a case whose threads both made no progress for `--stall-s` seconds: it prints `STALL`, every
thread's Python stack, and exits 3. `--guard` runs every program under `jaxrl_vlm.device_lock.exclusive`
(held from dispatch until the outputs are ready). XLA's own collective timeout is raised above the watchdog's
so a stall is seen as one, not as XLA's abort.

The last line of a case: `case C guard G: OK (T trainer steps, E engine steps in S s)` or `... STALL ...`.
With --all, one line per case and a summary. `--fsdp` splits the trainer's weights too (all-gathers and
reduce-scatters in its step), `--stage-every N` reshards its (donated, in flight) weights onto the engine every N
trainer steps from the trainer's thread, as the in-memory weight sync does.

Findings (2026-12-06, jax/jaxlib 0.10.2, the 2-core machine under a load average of 10-20):
* No stall. `--all --seconds 30 --stall-s 20 --fsdp --stage-every 5`: 10 cases (5 placements, guard off and on),
  0 stalled, 2,300-7,700 trainer steps and 4,600-20,000 engine steps each; single runs of train+tp4 (60 s, 31,920
  trainer and 11,612 engine steps) and train+tp8 (40 s, with --fsdp --stage-every 5) did not stall either. Two
  threads' collective programs on shared XLA:CPU devices take turns by themselves here: this jaxlib's CPU client
  orders the launches of collective programs (one at a time, the same order on every device).
* What the main job on 8 devices beside its in-process engine did show (tests/test_one_process_devices.py, the
  same failure with the device lock and without it): `Invalid buffer passed to Execute() as argument 1: Buffer has
  been deleted or donated`, then SIGSEGV, in the engine's prefill after a weight sync. jax 0.10.2's
  `device_put(x, sharding, may_alias=False)` of an array replicated on the trainer's 8 devices onto an engine's 2
  returns x's own per-device buffers; the trainer's next step donated them. Fixed in
  `jaxrl_vlm.engine.weights.place_weights` (a real copy). A program handed a deleted buffer on some of its devices
  is one way for the other participants of its collectives to wait forever.
* The stall's signature (all 8 participants of one run waiting in an all-reduce rendezvous) is also the one of the
  cached train step of item 2 (scripts/repro_compile_cache_abort.py: the devices of one run wait in different
  all-reduces), and the suite ran with the persistent cache on then; the cache fence (jaxrl_vlm/compile_cache.py)
  keeps that step out of it.
* So the product keeps the device lock (jaxrl_vlm/device_lock.py) as the guarantee this jaxlib gives by itself,
  for the backends that do not (a GPU stream runs collectives in enqueue order), and for any other jaxlib.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CASES = ("train+tp1", "train+tp2", "train+tp4", "train+tp8", "train+disjoint")


def _flags() -> str:
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split()
            if not f.startswith(("--xla_force_host_platform_device_count", "--xla_cpu_collective"))]
    return " ".join([*kept, "--xla_force_host_platform_device_count=8",
                     "--xla_cpu_collective_timeout_seconds=3600",
                     "--xla_cpu_collective_call_terminate_timeout_seconds=3600"])


def run_case(case: str, seconds: float, guard: bool, stall_s: float, ahead: int, width: int, fsdp: bool,
             stage_every: int) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    sys.path.insert(0, str(REPO))
    from jaxrl_vlm.device_lock import exclusive

    devices = jax.devices()
    assert len(devices) == 8, f"8 simulated devices expected, got {len(devices)}"
    train_devs = devices[:4] if case == "train+disjoint" else devices
    engine_devs = {"train+tp1": devices[:1], "train+tp2": devices[:2], "train+tp4": devices[:4],
                   "train+tp8": devices, "train+disjoint": devices[4:]}[case]

    # ---- the trainer: data parallel, replicated weights, donated state -> gradient all-reduce
    tmesh = Mesh(np.array(train_devs), ("data",))
    rep, rows = NamedSharding(tmesh, P()), NamedSharding(tmesh, P("data"))
    wsh = rows if fsdp else rep  # FSDP: weights split over `data` too (all-gathers and reduce-scatters)
    state = {"w1": jax.device_put(np.random.default_rng(0).normal(size=(width, width)).astype(np.float32) * 0.05, wsh),
             "w2": jax.device_put(np.random.default_rng(1).normal(size=(width, width)).astype(np.float32) * 0.05, wsh),
             "step": jax.device_put(np.zeros((), np.int32), rep)}
    batch = jax.device_put(np.random.default_rng(2).normal(size=(8 * len(train_devs), width)).astype(np.float32), rows)

    def train_step(state, x):
        def loss(p):
            return jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"] ** 2)
        g = jax.grad(loss)({"w1": state["w1"], "w2": state["w2"]})
        return {"w1": state["w1"] - 1e-3 * g["w1"], "w2": state["w2"] - 1e-3 * g["w2"], "step": state["step"] + 1}

    train = jax.jit(train_step, donate_argnums=0, out_shardings={"w1": wsh, "w2": wsh, "step": rep})

    # ---- the engine: tensor parallel over its devices (an all-reduce when it has several), donated cache
    emesh = Mesh(np.array(engine_devs), ("tensor",))
    cols, erows, erep = NamedSharding(emesh, P(None, "tensor")), NamedSharding(emesh, P("tensor", None)), NamedSharding(emesh, P())
    params = (jax.device_put(np.ones((width, width), np.float32) * 0.01, cols),
              jax.device_put(np.ones((width, width), np.float32) * 0.01, erows))
    cache = jax.device_put(np.zeros((16, width), np.float32), erep)

    def decode(params, cache, tok):
        h = jnp.tanh((cache + tok) @ params[0])   # columns split over `tensor`
        y = h @ params[1]                          # rows split: partial sums, all-reduced
        return cache * 0.5 + y, jnp.argmax(y, axis=-1)

    engine = jax.jit(decode, donate_argnums=1, out_shardings=(erep, erep))
    tok = jax.device_put(np.ones((16, width), np.float32), erep)

    progress = {"trainer": 0, "engine": 0}
    shared = {"params": params}
    stop = threading.Event()
    errors: list[BaseException] = []

    def guarded(devs):
        return exclusive(devs) if guard else _null()

    def trainer_loop():
        nonlocal state
        try:
            while not stop.is_set():
                for _ in range(ahead):
                    with guarded(train_devs):
                        state = train(state, batch)
                        if guard:
                            jax.block_until_ready(state)
                    progress["trainer"] += 1
                    if stage_every and progress["trainer"] % stage_every == 0:
                        # in-memory weight sync from the trainer's thread: its weights (still in flight) resharded
                        # onto the engine's placement while the engine runs
                        with guarded(set(train_devs) | set(engine_devs)):
                            staged = jax.device_put(state["w1"], cols)
                            if guard:
                                jax.block_until_ready(staged)
                        shared["params"] = (staged, params[1])
                jax.block_until_ready(state)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    def engine_loop():
        nonlocal cache
        try:
            while not stop.is_set():
                with guarded(engine_devs):
                    cache, ids = engine(shared["params"], cache, tok)
                    jax.device_get(ids)  # the scheduler reads every step's tokens
                progress["engine"] += 1
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    # compile both first, alone (a stall while compiling would be another story)
    state = train(state, batch)
    cache, _ = engine(params, cache, tok)
    jax.block_until_ready((state, cache))

    threads = [threading.Thread(target=trainer_loop, name="trainer", daemon=True),
               threading.Thread(target=engine_loop, name="engine", daemon=True)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    last, last_change = dict(progress), time.monotonic()
    label = f"case {case} guard {'on' if guard else 'off'}"
    while time.monotonic() - t0 < seconds and not errors:
        time.sleep(0.5)
        now = dict(progress)
        if now != last:
            last, last_change = now, time.monotonic()
        elif time.monotonic() - last_change > stall_s:
            print(f"STALL: no progress for {stall_s:g} s; every thread's stack:", flush=True)
            faulthandler.dump_traceback(all_threads=True)
            print(f"{label}: STALL (after {progress['trainer']} trainer steps, {progress['engine']} engine steps, "
                  f"{time.monotonic() - t0:.0f} s)", flush=True)
            os._exit(3)
    stop.set()
    for t in threads:
        t.join(stall_s)
    if errors:
        print(f"{label}: ERROR {errors[0]!r}", flush=True)
        return 1
    print(f"{label}: OK ({progress['trainer']} trainer steps, {progress['engine']} engine steps in "
          f"{time.monotonic() - t0:.0f} s)", flush=True)
    return 0


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", choices=CASES, default="train+tp4")
    p.add_argument("--all", action="store_true", help="Every case, without and with the guard, one process each.")
    p.add_argument("--seconds", type=float, default=120.0, help="How long a case runs when it does not stall.")
    p.add_argument("--stall-s", type=float, default=30.0, help="No progress for this long is a stall.")
    p.add_argument("--guard", action="store_true", help="Run every program under jaxrl_vlm.device_lock.exclusive.")
    p.add_argument("--ahead", type=int, default=8, help="Trainer steps dispatched before it waits.")
    p.add_argument("--width", type=int, default=128, help="Matrix side of both programs.")
    p.add_argument("--fsdp", action="store_true", help="Trainer weights split over its devices (FSDP).")
    p.add_argument("--stage-every", type=int, default=0,
                   help="Every N engine steps, reshard the trainer's weights onto the engine (in-memory sync).")
    ns = p.parse_args(argv)
    if not ns.all:
        if "xla_force_host_platform_device_count=8" not in os.environ.get("XLA_FLAGS", "") or \
                "collective_timeout_seconds=3600" not in os.environ.get("XLA_FLAGS", ""):
            env = {**os.environ, "XLA_FLAGS": _flags(), "JAX_PLATFORMS": "cpu"}
            return subprocess.call([sys.executable, __file__, *(argv if argv is not None else sys.argv[1:])], env=env)
        return run_case(ns.case, ns.seconds, ns.guard, ns.stall_s, ns.ahead, ns.width, ns.fsdp, ns.stage_every)
    results = []
    for case in CASES:
        for guard in (False, True):
            argv_case = ["--case", case, "--seconds", str(ns.seconds), "--stall-s", str(ns.stall_s),
                         "--ahead", str(ns.ahead), "--width", str(ns.width), "--stage-every", str(ns.stage_every),
                         *(["--fsdp"] if ns.fsdp else []), *(["--guard"] if guard else [])]
            env = {**os.environ, "XLA_FLAGS": _flags(), "JAX_PLATFORMS": "cpu"}
            done = subprocess.run([sys.executable, __file__, *argv_case], env=env, capture_output=True, text=True,
                                  timeout=ns.seconds + 10 * ns.stall_s + 300)
            line = (done.stdout.strip().splitlines() or [f"case {case}: no output, rc {done.returncode}"])[-1]
            print(line, flush=True)
            results.append((case, guard, done.returncode))
    stalls = [(c, g) for c, g, rc in results if rc == 3]
    print(f"repro: {len(results)} cases, {len(stalls)} stalled: {stalls}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
