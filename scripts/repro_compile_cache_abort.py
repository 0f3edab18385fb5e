"""Reproduce the persistent-compilation-cache abort of the trainer's step (issue 49, item 2).

Each case runs the same worker in fresh Python processes sharing one fresh cache directory: the first compiles and
writes JAX's persistent compilation cache, the next ones (--loads) read the executables back and train. A case
"aborts" when a loading process dies of SIGABRT (exit code -6).

    python scripts/repro_compile_cache_abort.py --loads 4          # dp-unfenced and dp-fenced
    python scripts/repro_compile_cache_abort.py --case dp-unfenced --loads 4 --work /tmp/cc-repro-N
    python scripts/repro_compile_cache_abort.py --list
    REPRO_ROOT=/tmp/wt-1ff026d python scripts/repro_compile_cache_abort.py --case dp-1ff026d-flags   # another tree

Findings (2026-12-06, jax/jaxlib 0.10.2, the 2-core machine; Trainer on a tiny Qwen3-VL, 3 steps, 8 simulated
devices, XLA's default optimisation level and 40 s collective timeouts, as the suite ran on 1ff026d):
* The abort is XLA:CPU's collective rendezvous timeout: in a process whose train step came from the cache, the
  devices of one run wait in different all-reduces (1ff026d: devices 0,1 at op_id 1, devices 3,4 at op_id 135) or
  only 4 of 8 arrive (HEAD: op_id 124); after 40 s XLA logs `Termination timeout ... Exiting to ensure a consistent
  program state` and aborts (LOG(FATAL) -> SIGABRT; the suite's xdist workers showed only Python's "Fatal Python
  error: Aborted").
* It is intermittent and needs the donated train step loaded from the cache: dp-1ff026d-flags (1ff026d) aborted
  1/1, one-then-dp-1ff026d-flags 1/1, the same two without donation 0/2; on HEAD (aa718d7 + the fence)
  dp-unfenced aborted 4 of 9 loads, dp-fenced (the step compiled in each process, everything else from the cache)
  0 of 10. Every write ran. The aborted loads of one cache showed the same RunId and op_id (-766829133, 124).
* At the suite's optimisation level 0 (and its 900 s collective timeouts) no load aborted or hung (fsdp, dp, 1 and
  8 devices, with and without donation): the suite's test_train_layouts.py twice on HEAD passed.
* The cache directory is part of the cache keys (jax adds it to the compile options): a copied cache never hits.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(os.environ.get("REPRO_ROOT", Path(__file__).resolve().parents[1])).resolve()

# name -> worker options
CASES: dict[str, dict] = {
    "trainer-8dev-fsdp-opt0": dict(kind="trainer", devices=8, layout="fsdp", opt_level="0"),
    "trainer-8dev-dp-opt0": dict(kind="trainer", devices=8, layout="dp", opt_level="0"),
    "trainer-8dev-fsdp-optdefault": dict(kind="trainer", devices=8, layout="fsdp", opt_level=None),
    "trainer-1dev-opt0": dict(kind="trainer", devices=1, layout="one", opt_level="0"),
    "trainer-8dev-fsdp-opt0-nodonate": dict(kind="trainer", devices=8, layout="fsdp", opt_level="0", donate=False),
    "trainer-8dev-fsdp-1ff026d-flags": dict(kind="trainer", devices=8, layout="fsdp", steps=3, opt_level=None,
                                           timeouts=False),
    "one-then-dp-1ff026d-flags": dict(kind="trainer", devices=8, layouts=["one", "dp"], steps=3, opt_level=None,
                                      timeouts=False),
    "one-then-dp-1ff026d-flags-nodonate": dict(kind="trainer", devices=8, layouts=["one", "dp"], steps=3,
                                               opt_level=None, timeouts=False, donate=False),
    "dp-1ff026d-flags": dict(kind="trainer", devices=8, layout="dp", steps=3, opt_level=None, timeouts=False),
    "dp-1ff026d-flags-nodonate": dict(kind="trainer", devices=8, layout="dp", steps=3, opt_level=None, timeouts=False,
                                      donate=False),
    # the current product: the step as before the fence, and as fenced (jaxrl_vlm/rl/train_step.py)
    "dp-unfenced": dict(kind="trainer", devices=8, layout="dp", steps=3, opt_level=None, timeouts=False, fence=False),
    "dp-fenced": dict(kind="trainer", devices=8, layout="dp", steps=3, opt_level=None, timeouts=False),
    "one-then-dp-opt0": dict(kind="trainer", devices=8, layouts=["one", "dp"], steps=3, opt_level="0", timeouts=False),
    # tests/test_train_layouts.py as on 1ff026d: one process, the 1-device baseline then every layout, 3 steps each,
    # XLA:CPU's default optimisation level and collective timeouts
    "layouts-seq-1ff026d-flags": dict(kind="trainer", devices=8, layouts=["one", "dp", "fsdp", "fsdp_tp", "tp"],
                                      steps=3, opt_level=None, timeouts=False),
}
DEFAULT_CASES = ["dp-unfenced", "dp-fenced"]


def child_env(cache_dir: Path, devices: int, opt_level: str | None, timeouts: bool = True) -> dict[str, str]:
    """The test suite's environment (tests/conftest.py), with the given device count and optimisation level
    (`timeouts`: the suite's 900 s collective timeouts; without them XLA:CPU's defaults, as on 1ff026d)."""
    env = dict(os.environ)
    flags = [f"--xla_force_host_platform_device_count={devices}"]
    if timeouts:
        flags += ["--xla_cpu_collective_timeout_seconds=900", "--xla_cpu_collective_call_terminate_timeout_seconds=900"]
    if opt_level is not None:
        flags.append(f"--xla_backend_optimization_level={opt_level}")
    env["XLA_FLAGS"] = " ".join(flags)
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_COMPILATION_CACHE_DIR"] = str(cache_dir)
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    return env


# ------------------------------------------------------------------------------------------------ worker side
def _test_image(seed: int, size):
    import numpy as np
    from PIL import Image

    width, height = (size, size) if isinstance(size, int) else size
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    phase = rng.uniform(0, 2 * np.pi, size=3)
    freq = rng.uniform(0.02, 0.2, size=(3, 2))
    base = np.stack([127.5 + 90.0 * np.sin(freq[c, 0] * xx + freq[c, 1] * yy + phase[c]) for c in range(3)], -1)
    blocks = rng.integers(-30, 31, size=(height // 8 + 1, width // 8 + 1, 3)).repeat(8, 0).repeat(8, 1)
    return Image.fromarray(np.clip(base + blocks[:height, :width], 0, 255).astype(np.uint8))


def run_trainer(opts: dict, model_dir: Path, out_dir: Path) -> dict:
    """`opts["steps"]` train steps of a fresh Trainer per layout of `opts["layouts"]` (as tests/test_train_layouts.py
    builds them; "one": --mesh-data 1 on the first device), in this one process; the losses of each."""
    import jax

    from _train_samples import train_samples
    from jaxrl_vlm.config import load_config
    from jaxrl_vlm.job.trainer import Trainer

    if not opts.get("donate", True):
        # No donation anywhere in the train step (also on trees whose Trainer has no `share_params`).
        import jaxrl_vlm.rl.train_step as ts

        class _NoDonate:
            def __getattr__(self, name):
                return getattr(jax, name)

            @staticmethod
            def jit(*a, **k):
                k.pop("donate_argnums", None)
                return jax.jit(*a, **k)

        ts.jax = _NoDonate()
    if not opts.get("fence", True):
        # The step as before the fence: compiled through the persistent cache like every other program.
        import jaxrl_vlm.rl.train_step as ts

        if hasattr(ts, "fenced_from_persistent_cache"):
            ts.fenced_from_persistent_cache = lambda devices: False
    samples = train_samples(model_dir, _test_image)
    losses = {}
    for layout in opts.get("layouts") or [opts["layout"]]:
        one = layout == "one"
        mesh = ["--mesh-data", "1"] if one else ["--mesh-config", str(ROOT / "configs" / "mesh" / f"{layout}.yaml")]
        cfg = load_config(None, [
            "--hf-checkpoint", str(model_dir), "--lr", "1e-3", "--weight-decay", "0.01",
            "--use-kl-loss", "--kl-loss-coef", "0.1", "--kl-loss-type", "k3", "--entropy-coef", "0.01",
            "--seq-buckets", "256,512", "--row-buckets", "8,16", "--patch-buckets", "0,64,128",
            "--logprob-chunk-size", "64", "--output-dir", str(out_dir), *mesh,
        ])
        trainer = Trainer(cfg, devices=jax.devices()[:1] if one else jax.devices()[: opts["devices"]])
        trainer.build_policy(model_dir)
        losses[layout] = [float(trainer.train_on(samples)["train/loss_total"]) for _ in range(opts.get("steps", 2))]
        print(f"layout {layout}: losses {losses[layout]}", flush=True)
    return {"losses": losses}


def worker(opts: dict, model_dir: Path, out_dir: Path) -> None:
    import logging

    import jax

    logging.basicConfig(level=logging.WARNING)
    # jax's cache hits and misses, to show which programs came back from the disk
    logging.getLogger("jax._src.compiler").setLevel(logging.DEBUG if opts.get("verbose") else logging.WARNING)
    t0 = time.time()
    result = run_trainer(opts, model_dir, out_dir)
    result["seconds"] = round(time.time() - t0, 1)
    result["devices"] = len(jax.devices())
    print("RESULT " + json.dumps(result), flush=True)


# ------------------------------------------------------------------------------------------------ driver side
def make_model(model_dir: Path, arch: str) -> None:
    """The tiny model, built once in its own process (no XLA program of it enters the cache under test)."""
    code = ("import sys; from jaxrl_vlm.tiny import make_tiny; "
            "make_tiny(sys.argv[1], seed=3, arch=sys.argv[2])")
    env = child_env(model_dir.parent / "model-cache-unused", 1, None)
    env.pop("JAX_COMPILATION_CACHE_DIR")
    subprocess.run([sys.executable, "-c", code, str(model_dir), arch], env=env, check=True, cwd=ROOT)


def run_once(opts: dict, cache_dir: Path, model_dir: Path, out_dir: Path, timeout: float) -> tuple[int, dict | None, str]:
    env = child_env(cache_dir, opts["devices"], opts.get("opt_level"), opts.get("timeouts", True))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(opts), str(model_dir), str(out_dir)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
    return proc.returncode, result, proc.stderr[-3000:]


def run_case(name: str, opts: dict, work: Path, model_dir: Path, timeout: float, load_only: str | None = None,
             loads: int = 1) -> dict:
    """The write, then `loads` loads of the same cache (each in a fresh process)."""
    cache_dir = work / f"cache-{name}"
    outcome: dict = {"case": name, "write": {"rc": 0, "result": None}, "loads": []}
    phases = ["write"] + ["load"] * loads
    if load_only:
        # The cache's directory is part of the cache keys (jax puts it in the compile options): the load runs on
        # the writer's directory, restored from a pristine copy kept beside it.
        cache_dir = Path(load_only)
        pristine = cache_dir.with_name(cache_dir.name + ".pristine")
        if not pristine.exists():
            shutil.copytree(cache_dir, pristine)
        shutil.rmtree(cache_dir)
        shutil.copytree(pristine, cache_dir)
        phases = ["load"] * loads
    for phase in phases:
        t0 = time.time()
        rc, result, err = run_once(opts, cache_dir, model_dir, work / f"out-{name}-{phase}", timeout)
        entries = len(list(cache_dir.glob("*"))) if cache_dir.is_dir() else 0
        record = {"rc": rc, "result": result, "wall_s": round(time.time() - t0, 1), "cache_entries": entries}
        if phase == "write":
            outcome["write"] = record
        else:
            outcome["loads"].append(record)
        verdict = "ABORT (SIGABRT)" if rc == -6 else ("ok" if rc == 0 else f"exit {rc}")
        print(f"[{name}] {phase}: {verdict} rc={rc} result={result} wall={record['wall_s']}s "
              f"cache_entries={entries}", flush=True)
        if rc != 0:
            stuck = sorted({line.split("] ", 1)[-1][:200] for line in err.splitlines() if "Termination timeout" in line})
            print(f"[{name}] {phase} stderr (rendezvous lines): {stuck or err[-1500:]}", flush=True)
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", action="append", help="a case name (repeatable); default: all")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--work", help="work directory (default: a fresh temporary one)")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--load-only", metavar="CACHE",
                        help="skip the write: run the case once more on this cache directory as its writer left it "
                             "(with the writer's --work)")
    parser.add_argument("--loads", type=int, default=1, help="loads of each written cache (the abort is intermittent)")
    parser.add_argument("--arch", default="qwen3_vl", help="the tiny model's family (make_tiny's arch)")
    parser.add_argument("--worker", nargs=3, metavar=("OPTS", "MODEL_DIR", "OUT_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        opts, model_dir, out_dir = args.worker
        worker(json.loads(opts), Path(model_dir), Path(out_dir))
        return
    if args.list:
        for name, opts in CASES.items():
            print(name, opts)
        return
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="cc-repro-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / f"model-{args.arch}"
    if not (model_dir / "config.json").is_file():
        make_model(model_dir, args.arch)
    outcomes = [run_case(name, CASES[name], work, model_dir, args.timeout, args.load_only, args.loads) for name in (args.case or DEFAULT_CASES)]
    print("\nsummary:")
    for o in outcomes:
        w, loads = o["write"], o["loads"]
        aborts = sum(r["rc"] == -6 for r in loads)
        ok = [r for r in loads if r["rc"] == 0]
        same = all((r["result"] or {}).get("losses") == (w["result"] or {}).get("losses") for r in ok) if w["result"] else None
        print(f"  {o['case']}: write rc={w['rc']}; loads: {len(ok)} ran, {aborts} ABORTED (SIGABRT, rc -6), "
              f"{len(loads) - len(ok) - aborts} other (rc {[r['rc'] for r in loads]})"
              + ("" if same is None else f"; losses as written: {same}"))


if __name__ == "__main__":
    main()
