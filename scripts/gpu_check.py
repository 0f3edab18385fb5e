"""One-GPU acceptance check: parity on GPU, one Qwen3-VL-2B GRPO train step (MFU, memory), the sharding bench.

Run it through `scripts/gpu_check.sh` (sets the environment, bounds the time). It installs nothing and
reaches no network. What the machine needs:
  * an NVIDIA GPU with a driver recent enough for CUDA 12 (H100/H200-class for the MFU target);
  * the project venv (`.venv`, or `PYTHON=...`) with this repo's dependencies plus a CUDA build of
    jaxlib 0.10.2, i.e. `pip install -e '.[test]' 'jax[cuda12]==0.10.2'` done beforehand; the test extra
    brings the CPU torch that the parity test uses as its reference;
  * nothing else: the model is the real 2B architecture with random weights, the batch is synthetic.

Stages (each reported in the final summary block, even when an earlier one failed):
  1. parity: `pytest tests/test_model_parity.py` in a subprocess on the GPU, with fp32 matmuls at full
     precision (JAX_DEFAULT_MATMUL_PRECISION=highest, NVIDIA_TF32_OVERRIDE=0): TF32, the GPU default for
     fp32 dots, is ~1e-3 relative and would fail the 1e-4 logit tolerance for a reason that is not a bug;
  2. train step: `configs/geo3k_qwen3vl_2b.yaml` (fp32 params, bf16 compute, full remat, chunked log-probs)
     on the 2B shape, a synthetic multi-turn batch of 8 rows x 4096 tokens with images; compiled once
     (fit checked from the compiled memory analysis before any weights exist), then 1 warm-up + 3 timed
     steps; MFU vs the matmul peak measured in this run and vs 989 TFLOP/s (H100/H200 dense bf16);
  3. sharding bench: every configs/mesh layout on the one device with the `small` model (fsdp_tp needs
     2 devices and is reported as unbuildable).

`--dry-run` runs the same code on CPU with the tiny model and short rows (no GPU needed; used by tests).
Exit status: 0 when every stage that ran passed, 1 when one failed, 2 when there is no usable GPU.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

H100_BF16_PEAK = 989e12  # dense bf16 tensor-core peak of H100 SXM / H200, FLOP/s
MFU_TARGET = 0.40


@dataclass
class PytestResult:
    ok: bool
    passed: int
    failed: int
    errors: int
    seconds: float
    summary: str  # pytest's final line, or why it did not finish
    tail: str = ""  # last lines of output when it failed


@dataclass
class Stage:
    name: str
    status: str = "skipped"  # pass | fail | skipped
    lines: list[str] = field(default_factory=list)


def run_pytest(paths: list[str], env: dict[str, str], timeout_s: float, cwd: Path = ROOT) -> PytestResult:
    """Run pytest on `paths` in a subprocess; counts come from its final summary line."""
    cmd = [sys.executable, "-m", "pytest", *paths, "-q", "-n", "0", "-p", "no:cacheprovider"]  # one process: one GPU
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return PytestResult(False, 0, 0, 0, time.perf_counter() - t0, f"timed out after {timeout_s:.0f} s",
                            "\n".join(out.splitlines()[-20:]))
    seconds = time.perf_counter() - t0
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    summary = next((ln.strip("= ") for ln in reversed(lines) if re.search(r"\b(passed|failed|error|no tests ran)\b", ln)), "")
    count = lambda word: int(m.group(1)) if (m := re.search(rf"(\d+) {word}", summary)) else 0  # noqa: E731
    passed, failed, errors = count("passed"), count("failed"), count("error")
    ok = proc.returncode == 0 and passed > 0
    return PytestResult(ok, passed, failed, errors, seconds, summary or f"pytest exited {proc.returncode}",
                        "" if ok else "\n".join(lines[-30:]))


def parity_env(dry_run: bool) -> dict[str, str]:
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu" if dry_run else "cuda"
    env["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"
    env["NVIDIA_TF32_OVERRIDE"] = "0"
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return env


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _flop(n: float | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / 1e12:.2f} TFLOP" if n >= 1e11 else f"{n / 1e9:.2f} GFLOP"


def _gib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.1f} GiB"


def check_backend(dry_run: bool) -> tuple[list, str | None]:
    """(devices to use, error message or None). Imports jax: call after setting the environment."""
    import jax

    try:
        devices = jax.devices()
    except RuntimeError as e:
        return [], f"jax could not start a backend: {e}"
    if dry_run:
        return devices[:1], None
    gpus = [d for d in devices if d.platform == "gpu"]
    if not gpus:
        return [], (
            f"jax {jax.__version__} sees no CUDA GPU (backend {jax.default_backend()}, devices {devices}). "
            "This check needs a CUDA build of jaxlib in the project venv, installed beforehand: "
            "pip install 'jax[cuda12]==0.10.2' (plus an NVIDIA driver for CUDA 12). It installs nothing itself."
        )
    return gpus[:1], None


def train_step_stage(args: argparse.Namespace, devices: list) -> Stage:
    """The 2B train step with the config's attention; if the fused kernel fails to build on this GPU, the
    failure is reported and the step is measured again with the XLA attention."""
    stage = Stage("train step")
    try:
        _measure_train_step(args, devices, stage, overrides=[])
    except Exception as e:  # noqa: BLE001 - reported; the exit status says it failed
        stage.status = "fail"
        stage.lines += [f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
                        "retrying with --attention-impl xla"]
        retry = Stage("train step (xla attention)")
        _measure_train_step(args, devices, retry, overrides=["--attention-impl", "xla"])
        stage.lines += ["  " + line for line in retry.lines] + [f"  xla attention: {retry.status.upper()}"]
    return stage


def _measure_train_step(args: argparse.Namespace, devices: list, stage: Stage, overrides: list[str]) -> None:
    from jaxrl_vlm.bench.sharding_bench import OK, BenchOptions, run_sharding_bench, write_outputs

    model = "tiny" if args.dry_run else "qwen3_vl_2b"
    opts = BenchOptions(model=model, rows=8, seq_len=args.seq_len, steps=args.steps, warmup=1)
    report = run_sharding_bench(str(ROOT / args.config), [str(ROOT / "configs/mesh/dp.yaml")], opts,
                                overrides=overrides, devices=devices)
    write_outputs(report, args.out, stem="train_step")
    r, info = report.results[0], report.info
    stage.lines.append(
        f"{model} ({_count(info['params'])} params) random init, {info['param_dtype']} params, "
        f"{info['compute_dtype']} compute, remat {info['remat']}, attention {info.get('attention_impl', '?')}; "
        f"batch KxRxTxP {r.batch_shape or 'n/a'} ({info['samples']} multi-turn episodes, {r.real_tokens or 0} real tokens)"
    )
    if r.status != OK:
        stage.status = "fail"
        stage.lines.append(f"status {r.status}: {r.reason}")
        stage.lines.append(f"compiled footprint {_gib(r.peak_bytes)} per device of {_gib(r.device_bytes)}")
        return
    achieved = r.tflops_per_device * 1e12
    mfu_989 = achieved / H100_BF16_PEAK
    stage.status = "pass"
    stage.lines += [
        f"step time {r.step_ms:.1f} ms (median of {args.steps}; compile {r.compile_s:.1f} s), {r.tokens_per_s:,.0f} real tokens/s",
        f"model FLOPs {_flop(r.model_flops)}/step -> {_flop(achieved)}/s "
        f"(XLA cost analysis {_flop(r.hlo_flops)}, which counts loop bodies once)",
        "MFU " + (f"{100 * r.mfu:.1f}% of the measured matmul peak ({_flop(r.peak_tflops_measured * 1e12)}/s), " if r.mfu else "")
        + f"{100 * mfu_989:.1f}% of 989 TFLOP/s (H100/H200 bf16 dense)"
        + ("" if args.dry_run else f"; target >= {100 * MFU_TARGET:.0f}%: {'met' if mfu_989 >= MFU_TARGET else 'NOT met'}"),
        f"memory per device: compiled {_gib(r.peak_bytes)} (arguments {_gib(r.arg_bytes)}, temporaries {_gib(r.temp_bytes)}), "
        f"allocator peak {_gib(r.measured_peak_bytes)}, device {_gib(r.device_bytes)}",
    ]
    if args.require_mfu is not None and mfu_989 < args.require_mfu:
        stage.status = "fail"
        stage.lines.append(f"MFU {100 * mfu_989:.1f}% < required {100 * args.require_mfu:.0f}%")


def sharding_stage(args: argparse.Namespace, devices: list) -> Stage:
    from jaxrl_vlm.bench.sharding_bench import OK, UNBUILDABLE, BenchOptions, run_sharding_bench, write_outputs

    stage = Stage("sharding bench")
    model = "tiny" if args.dry_run else "small"
    layouts = args.layouts or sorted(str(p) for p in (ROOT / "configs/mesh").glob("*.yaml"))
    opts = BenchOptions(model=model, rows=8, seq_len=args.bench_seq_len, steps=args.steps, warmup=1)
    report = run_sharding_bench(str(ROOT / args.config), layouts, opts, devices=devices)
    paths = write_outputs(report, args.out)
    bad = [r for r in report.results if r.status not in (OK, UNBUILDABLE)]
    stage.status = "fail" if bad else "pass"
    stage.lines.append(f"{model} model on {len(devices)} device: outputs {paths['csv'].parent}")
    for r in report.results:
        if r.status == OK:
            stage.lines.append(
                f"{r.layout:8s} ok  {r.step_ms:8.1f} ms  {_gib(r.peak_bytes)}/dev  collectives {r.collective_bytes} B"
            )
        else:
            stage.lines.append(f"{r.layout:8s} {r.status}: {r.reason}")
    return stage


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model, short rows: checks the script itself.")
    parser.add_argument("--skip-parity", action="store_true", help="Do not run tests/test_model_parity.py.")
    parser.add_argument("--config", default="configs/geo3k_qwen3vl_2b.yaml", help="Run config of the train step.")
    parser.add_argument("--layouts", nargs="*", default=None, help="Mesh layouts of the sharding bench (default: all).")
    parser.add_argument("--out", default="runs/gpu_check", help="Directory for CSV/JSON/PNG outputs.")
    parser.add_argument("--steps", type=int, default=3, help="Timed steps (after one warm-up).")
    parser.add_argument("--seq-len", type=int, default=None, help="Tokens per row of the train step (default 4096).")
    parser.add_argument("--bench-seq-len", type=int, default=None, help="Tokens per row in the sharding bench (default 1024).")
    parser.add_argument("--require-mfu", type=float, default=None, help="Fail when MFU vs 989 TFLOP/s is below this.")
    parser.add_argument("--budget-s", type=float, default=450.0, help="Skip later stages once this much time has passed.")
    parser.add_argument("--parity-timeout-s", type=float, default=240.0)
    args = parser.parse_args(argv)
    args.seq_len = args.seq_len or (128 if args.dry_run else 4096)
    args.bench_seq_len = args.bench_seq_len or (128 if args.dry_run else 1024)
    t_start = time.perf_counter()

    # Before jax starts: no pre-allocation, so the parity subprocess and this process share the GPU.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.90")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.dry_run:
        os.environ["JAX_PLATFORMS"] = "cpu"

    # The backend first (cheap without pre-allocation), so a machine without a usable GPU is told at once.
    devices, error = check_backend(args.dry_run)
    if error:
        print(f"gpu_check: {error}", file=sys.stderr)
        return 2
    import jax

    stages: list[Stage] = []
    parity = Stage("parity")
    if not args.skip_parity:
        res = run_pytest(["tests/test_model_parity.py"], parity_env(args.dry_run), args.parity_timeout_s)
        parity.status = "pass" if res.ok else "fail"
        parity.lines.append(f"{res.summary} ({res.seconds:.0f} s, {'CPU' if args.dry_run else 'GPU'}, fp32 highest precision)")
        if not res.ok and res.tail:
            parity.lines += ["  " + ln for ln in res.tail.splitlines()[-12:]]
    stages.append(parity)

    for name, fn in (("train step", train_step_stage), ("sharding bench", sharding_stage)):
        elapsed = time.perf_counter() - t_start
        if elapsed > args.budget_s:
            stages.append(Stage(name, "skipped", [f"time budget spent ({elapsed:.0f} s of {args.budget_s:.0f} s)"]))
            continue
        try:
            stages.append(fn(args, devices))
        except Exception as e:  # noqa: BLE001 - reported in the summary, and the exit status says it failed
            tb = traceback.format_exc().strip().splitlines()[-8:]
            stages.append(Stage(name, "fail", [f"{type(e).__name__}: {e}", *tb]))

    d = devices[0]
    bar = "=" * 30
    print(f"\n{bar} jaxrl-vlm GPU check {'(DRY RUN, CPU) ' if args.dry_run else ''}{bar}")
    print(f"device        : {d.device_kind} ({d.platform}), jax {jax.__version__}")
    for st in stages:
        print(f"{st.name:14s}: {st.status.upper()}")
        for line in st.lines:
            print(f"{'':16s}{line}")
    failed = [s.name for s in stages if s.status == "fail"]
    print(f"elapsed       : {time.perf_counter() - t_start:.0f} s (budget {args.budget_s:.0f} s)")
    print(f"result        : {'FAIL (' + ', '.join(failed) + ')' if failed else 'PASS'}")
    print("=" * (len(bar) * 2 + 21 + (16 if args.dry_run else 0)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
