"""Vision reuse (issue 47): train-step time and vision FLOPs with `--vision-reuse` on and off, on one set of rollouts.

    python scripts/bench_vision_reuse.py                                  # tiny, small and the 2B preset; cases 1 and 2
    python scripts/bench_vision_reuse.py --size small --cases 1 --repeats 7 --json /tmp/vision_reuse.json
    python scripts/bench_vision_reuse.py --size tiny --repeats 1 --micro-batch-size 4   # + run-config overrides

Cases (synthetic rollouts in the model's token ids, built ONCE per model and case; every arm trains on those samples):
  1  geo3k-like: P prompts x S samples (default 4 x 16), single turn; each prompt has one picture, which all its S
     samples show (a GRPO group), then a response of 64-192 tokens.
  2  color_reveal-like: 2 turns; the prompt picture, a short reply, then an observation that re-sends the prompt
     picture with the reveal picture (one per prompt, as color_reveal's reveal is a function of the card), and a
     second short reply. Each sample shows 3 pictures, 2 of them distinct within its group.
Pictures are --image-grid x --image-grid patches (default 16: 256 patches, 64 image tokens, a 256x256-pixel image).

Arms, per model and case, one batch each through the real `build_train_batch` (the sharding bench's `bench_batch`:
one seq bucket --seq-len, one row bucket --rows, patch buckets in steps of 256 patches; the defaults, 32 rows of 1024
tokens, hold either case in ONE micro-batch; fewer --rows split it, and then the batcher's placement of each group
decides how many micro-batches encode its picture):
  reuse off   `--vision-reuse false`: the tower encodes every copy of every picture (the layout before issue 47);
  reuse on    `--vision-reuse true`: it encodes each distinct picture once per micro-batch and gathers it;
  text only   the reuse-off batch with its vision inputs dropped (`vision=None`): the same tokens, rows, positions and
              segments, so the same text work, and no vision tower, image scatter or deepstack adds.
Each arm's real `train_step` (the trainer's StepConfig, as `jaxrl-vlm bench sharding` builds it) is AOT-compiled from
abstract state on one device; its first call (from the same random parameters for every arm) is the warm-up and
gives the grad-norm check; then --repeats rounds time one step of each arm in turn (alternating, so load from other
processes hits all arms alike); the medians are reported. Compilation is timed separately, never in a step.

Printed per model and case:
  images / distinct   image occurrences in the batch / images the tower encodes (`train/vision_images[_distinct]`);
  KxRxTxP             the batch shape: micro-batches, rows, tokens per row, (distinct) patches per micro-batch;
  vision GFLOP/step   forward + backward (3 x forward) of the tower, mergers and deepstack mergers over the batch:
                      `flops.py` is `bench.flops.forward_flops`'s vision terms, which count the patch attention as a
                      full P x P per micro-batch; `as run` counts it as the XLA program computes it, chunk by chunk
                      (`layers.local_segment_attention`: 3 blocks of keys per query block) once 3 x the largest frame
                      < P (`layers.patch_mask`), P x P otherwise. The matmul terms are the same in both;
  step s              median wall time of one compiled optimizer step (forward, backward, Adam), after warm-up;
  peak MiB            the compiled step's footprint on the device (XLA memory_analysis: args + outputs - donated +
                      temporaries);
  vision FLOPs off/on the ratio of the two arms' vision FLOPs (the issue's bar: >= 8x on `small`, 16 per picture);
  tower share         (step off - step text-only) / step off: the part of the reuse-off step that the vision path
                      costs (tower forward and backward, the scatter of its features, the deepstack adds), measured
                      as the difference of two programs on the same tokens. The optimizer's update of the vision
                      parameters runs in both (their gradient is zero without images), so it is not in the share;
  step fall           (step off - step on) / step off, and that fall / the tower share: the fraction of the vision
                      path's cost that reuse removes (the issue's bar: >= 70% on `small`).
The 2B preset (Qwen3-VL-2B-Instruct's architecture, bf16 compute and full remat like configs/geo3k_qwen3vl_2b.yaml)
is compiled, never run: vision FLOPs, XLA's cost_analysis FLOPs (which count the micro-batch scan's body once)
and the compiled footprint, reuse off against on.

Benchmarks are not tests: nothing here is asserted except that both arms compute the same gradients (grad norms
within 1e-3 relative, else the exit status is 1). Unrecognised `--flag value` pairs are run-config overrides
(`--micro-batch-size 4`, `--remat full`, `--compute-dtype bfloat16`, ...), applied to every size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl_vlm.batching import TrainBatch  # noqa: E402
from jaxrl_vlm.bench import flops as flops_lib  # noqa: E402
from jaxrl_vlm.bench.sharding_bench import (  # noqa: E402
    BenchOptions,
    bench_batch,
    host_params,
    init_state,
    largest_frame,
    model_config,
    plan_state,
    step_config,
)
from jaxrl_vlm.config import Config, ConfigError, load_config  # noqa: E402
from jaxrl_vlm.models.config import ModelConfig  # noqa: E402
from jaxrl_vlm.models.hf_io import param_count  # noqa: E402
from jaxrl_vlm.rl.train_step import train_step  # noqa: E402
from jaxrl_vlm.sharding.layout import batch_shardings, build_mesh  # noqa: E402
from jaxrl_vlm.sharding.rules import resolve_rules  # noqa: E402
from rollout.sample import Sample, Status  # noqa: E402

# --size names -> `sharding_bench.model_config` names (bench_lora's table); the 2B preset is compiled, never run.
SIZES = {"tiny": "tiny", "small": "small", "2b": "qwen3_vl_2b"}
EXECUTED = ("tiny", "small")
# The 2B reference run's step (configs/geo3k_qwen3vl_2b.yaml), before the command line's overrides.
PRESET_2B_OVERRIDES = ("--compute-dtype", "bfloat16", "--remat", "full")
CASES = {1: "geo3k-like, single turn, one picture per prompt", 2: "color_reveal-like, 2 turns, prompt picture re-sent"}
ARMS = ("off", "on", "text")
GRAD_NORM_RTOL = 1e-3


# ----------------------------------------------------------------------------- the rollouts


class Picture(NamedTuple):
    """One processed picture: its tokens (vision_start, pads, vision_end), grid_thw [1, 3], patches [h*w, patch_dim]."""

    tokens: list[int]
    grid: np.ndarray
    pixels: np.ndarray


def text_ids(rng: np.random.Generator, n: int, cfg: ModelConfig) -> list[int]:
    """`n` ordinary token ids (never an image, video or vision-boundary id)."""
    special = {cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id}
    ids = rng.integers(1, cfg.text.vocab_size, size=n)
    ids[np.isin(ids, list(special))] = 1
    return ids.tolist()


def picture(rng: np.random.Generator, cfg: ModelConfig, side: int) -> Picture:
    """A random side x side-patch picture. Samples showing it share these very arrays: their content hashes match."""
    if side % cfg.vision.spatial_merge_size:
        raise SystemExit(f"--image-grid {side}: not a multiple of spatial_merge_size={cfg.vision.spatial_merge_size}")
    pads = side * side // cfg.vision.merge_unit
    tokens = [cfg.vision_start_token_id, *([cfg.image_token_id] * pads), cfg.vision_end_token_id]
    pixels = rng.standard_normal((side * side, cfg.vision.patch_dim)).astype(np.float32)
    return Picture(tokens, np.array([[1, side, side]], np.int64), pixels)


def model_turn(s: Sample, rng: np.random.Generator, cfg: ModelConfig, lengths: tuple[int, int]) -> None:
    n = int(rng.integers(*lengths, endpoint=True))
    s.append_model_tokens(text_ids(rng, n, cfg), (-rng.uniform(0.01, 3.0, size=n)).tolist())


def finish(s: Sample, pictures: list[Picture], reward: float) -> Sample:
    s.multimodal_train_inputs = {"image_grid_thw": np.concatenate([p.grid for p in pictures]),
                                 "pixel_values": np.concatenate([p.pixels for p in pictures])}
    s.reward = reward
    s.set_status(Status.COMPLETED)
    return s


def group_rewards(rng: np.random.Generator, n: int) -> np.ndarray:
    """0/1 rewards, never all equal, so GRPO's advantages are non-zero."""
    r = rng.integers(0, 2, size=n).astype(float)
    if r.min() == r.max():
        r[0] = 1.0 - r[0]
    return r


def geo3k_like(cfg: ModelConfig, prompts: int, per_prompt: int, side: int, seed: int) -> list[Sample]:
    """Case 1: per prompt, one picture inside a 64-128-token question; each of its samples answers in 64-192 tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(prompts):
        pic = picture(rng, cfg, side)
        question = text_ids(rng, int(rng.integers(64, 128, endpoint=True)), cfg)
        prompt = question[:8] + pic.tokens + question[8:]
        for i, reward in enumerate(group_rewards(rng, per_prompt)):
            s = Sample(group_index=g, index=i, prompt=f"geo3k-like prompt {g}", label="1")
            s.set_prompt_tokens(prompt)
            model_turn(s, rng, cfg, (64, 192))
            out.append(finish(s, [pic], reward))
    return out


def color_reveal_like(cfg: ModelConfig, prompts: int, per_prompt: int, side: int, seed: int) -> list[Sample]:
    """Case 2: the prompt picture and a 16-32-token question; a reply of 8-24 tokens; an observation of 8-16 tokens
    that re-sends the prompt picture beside the prompt's reveal picture; a second reply of 8-24 tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(prompts):
        first, reveal = picture(rng, cfg, side), picture(rng, cfg, side)
        prompt = first.tokens + text_ids(rng, int(rng.integers(16, 32, endpoint=True)), cfg)
        for i, reward in enumerate(group_rewards(rng, per_prompt)):
            s = Sample(group_index=g, index=i, prompt=f"color_reveal-like prompt {g}", label="1")
            s.set_prompt_tokens(prompt)
            model_turn(s, rng, cfg, (8, 24))
            note = text_ids(rng, int(rng.integers(8, 16, endpoint=True)), cfg)
            s.append_observation_tokens(note[:4] + first.tokens + reveal.tokens + note[4:])
            model_turn(s, rng, cfg, (8, 24))
            out.append(finish(s, [first, first, reveal], reward))
    return out


BUILDERS = {1: geo3k_like, 2: color_reveal_like}


# ----------------------------------------------------------------------------- FLOPs and memory


def vision_attention_as_run(cfg: ModelConfig, shape_key: tuple[int, int, int, int], block: int | None) -> float:
    """Forward FLOPs of the patch attention as XLA's program computes it (QK^T and PV): `layers.patch_mask` switches
    to `local_segment_attention` once 3 x block < P, whose queries of each block-sized chunk see 3 chunks of keys;
    below that, the full P x P (masked) per micro-batch, which is what `flops.py` counts in every case."""
    k, _, _, p = shape_key
    v = cfg.vision
    pairs = -(-p // block) * block * 3 * block if block is not None and 3 * block < p else p * p
    return 4.0 * k * pairs * v.num_heads * v.head_dim * v.depth


def vision_flops(cfg: ModelConfig, shape_key: tuple[int, int, int, int], block: int | None) -> dict[str, float]:
    """Vision FLOPs of one optimizer step (3 x forward), as `flops.py` counts them and as the program runs them."""
    fwd = flops_lib.forward_flops(cfg, shape_key)
    return {
        "vision_flops": 3.0 * (fwd["vision_matmul"] + fwd["vision_attention"]),
        "vision_flops_as_run": 3.0 * (fwd["vision_matmul"] + vision_attention_as_run(cfg, shape_key, block)),
        "vision_matmul_flops": 3.0 * fwd["vision_matmul"],
        "step_flops": flops_lib.train_step_flops(cfg, shape_key),
    }


def peak_bytes(compiled: Any) -> int | None:
    mem = compiled.memory_analysis()
    if mem is None:
        return None
    return int(mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes)


def hlo_flops(compiled: Any) -> float | None:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    return float(cost["flops"]) if cost and "flops" in cost else None


# ----------------------------------------------------------------------------- one model, one case


def run_config(size: str, overrides: list[str], reuse: bool) -> Config:
    base = list(PRESET_2B_OVERRIDES) if size == "2b" else []
    return load_config(None, [*base, *overrides, "--vision-reuse", "true" if reuse else "false"])


def compile_arm(plan: Any, cfg: Config, batch: TrainBatch, arrays: Any, mesh: Any, rules: Any) -> tuple[Any, float]:
    """The real train step for `arrays` (the batch's arrays, or them without vision), AOT-compiled from abstract state
    with the trainer's shardings, as `jaxrl-vlm bench sharding` compiles it; and the seconds that took."""
    b_sh = batch_shardings(arrays, mesh, rules)
    fn = partial(train_step, plan.graphdef, plan.tx, step_config(cfg, batch, mesh, rules))
    jitted = jax.jit(fn, in_shardings=(plan.shardings, b_sh, None, None), out_shardings=(plan.shardings, None),
                     donate_argnums=(0,))
    abstract_batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), arrays)
    t0 = time.perf_counter()
    compiled = jitted.lower(plan.abstract, abstract_batch, None, None).compile()
    return compiled, time.perf_counter() - t0


def time_arms(compiled: dict[str, Any], arrays: dict[str, Any], plan: Any, params: Any, mesh: Any, rules: Any,
              ns: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Grad norm of each arm's first step from the same parameters (the warm-up), then --repeats rounds of one step of
    each arm in turn; per arm its grad norm and step times (median, min, all)."""
    device_batch = {arm: jax.device_put(x, batch_shardings(x, mesh, rules)) for arm, x in arrays.items()}
    out: dict[str, dict[str, Any]] = {arm: {} for arm in compiled}
    state = None
    for arm, step in compiled.items():
        state = init_state(plan, params, ns.seed)
        for _ in range(max(1, ns.warmup)):
            state, metrics = step(state, device_batch[arm], None, None)
            jax.block_until_ready(state)
            out[arm].setdefault("grad_norm", float(metrics["train/grad_norm"]))
    times: dict[str, list[float]] = {arm: [] for arm in compiled}
    for _ in range(ns.repeats):
        for arm, step in compiled.items():  # alternating: load from other processes hits every arm alike
            t0 = time.perf_counter()
            state, _ = step(state, device_batch[arm], None, None)
            jax.block_until_ready(state)
            times[arm].append(time.perf_counter() - t0)
    for arm, ts in times.items():
        out[arm].update(step_s=statistics.median(ts), step_s_min=min(ts), step_s_all=ts)
    return out


def measure(size: str, case: int, ns: argparse.Namespace, overrides: list[str],
            params_cache: dict[str, Any]) -> dict[str, Any]:
    """Build the case's samples once, batch them with reuse off and on, compile each arm's step and (tiny and small)
    time it. `params_cache` keeps the random host parameters of one model between its cases."""
    model_cfg = model_config(SIZES[size])
    samples = BUILDERS[case](model_cfg, ns.prompts, ns.samples_per_prompt, ns.image_grid, ns.seed)
    opts = BenchOptions(model=SIZES[size], rows=ns.rows, seq_len=ns.seq_len, seed=ns.seed, measure_peak=False)
    cfgs = {"off": run_config(size, overrides, False), "on": run_config(size, overrides, True)}
    cfgs["text"] = cfgs["off"]
    mesh = build_mesh(cfgs["off"].mesh, jax.devices()[:1])
    rules = resolve_rules(cfgs["off"].mesh.sharding_rules)
    batches = {arm: bench_batch(samples, model_cfg, cfgs[arm], opts, 1) for arm in ("off", "on")}
    batches["text"] = batches["off"]
    arrays = {"off": batches["off"].arrays, "on": batches["on"].arrays,
              "text": batches["off"].arrays._replace(vision=None)}
    arms = ARMS if size in EXECUTED else ("off", "on")  # the 2B preset: compiled only, no baseline needed
    block = largest_frame(samples)
    plan = plan_state(model_cfg, cfgs["off"], mesh, rules, patch_attention_block=block)
    row: dict[str, Any] = {
        "size": size, "model": SIZES[size], "params": param_count(model_cfg), "case": case, "case_name": CASES[case],
        "samples": len(samples), "prompts": ns.prompts, "samples_per_prompt": ns.samples_per_prompt,
        "image_grid": ns.image_grid, "frame_patches": block, "compute_dtype": cfgs["off"].model.compute_dtype,
        "remat": cfgs["off"].model.remat, "executed": size in EXECUTED, "arms": {},
    }
    compiled = {}
    for arm in arms:
        batch = batches[arm]
        compiled[arm], compile_s = compile_arm(plan, cfgs[arm], batch, arrays[arm], mesh, rules)
        k, r, t, p = batch.shape_key
        info = {"shape": f"{k}x{r}x{t}x{0 if arm == 'text' else p}", "compile_s": compile_s,
                "peak_bytes": peak_bytes(compiled[arm]), "hlo_flops": hlo_flops(compiled[arm]),
                "slots": batch.layout.slots, "real_tokens": batch.layout.real_tokens}
        if arm != "text":
            info.update(images=batch.layout.images, distinct_images=batch.layout.distinct_images,
                        real_patches=batch.layout.real_patches, **vision_flops(model_cfg, batch.shape_key, block))
        row["arms"][arm] = info
        if ns.verbose:
            print(f"  compiled {size} case {case} {arm}: {info['shape']} in {compile_s:.1f} s, footprint "
                  f"{_mib(info['peak_bytes'])} MiB", flush=True)
    if size in EXECUTED:
        key = f"{SIZES[size]}/{cfgs['off'].model.param_dtype}/{ns.seed}"
        if key not in params_cache:
            params_cache.clear()
            params_cache[key] = host_params(plan.abstract.params, ns.seed)
        for arm, measured in time_arms(compiled, arrays, plan, params_cache[key], mesh, rules, ns).items():
            row["arms"][arm].update(measured)
    return row


def summarize(row: dict[str, Any]) -> dict[str, Any]:
    """The ratios the issue's bars read, from one row's arms."""
    off, on = row["arms"]["off"], row["arms"]["on"]
    out = {"vision_flops_ratio": off["vision_flops"] / on["vision_flops"],
           "vision_flops_ratio_as_run": off["vision_flops_as_run"] / on["vision_flops_as_run"],
           "real_patches_ratio": off["real_patches"] / max(1, on["real_patches"])}
    if row["executed"]:
        t_off, t_on, t_text = off["step_s"], on["step_s"], row["arms"]["text"]["step_s"]
        out["tower_share"] = (t_off - t_text) / t_off
        out["step_fall"] = (t_off - t_on) / t_off
        out["fall_over_share"] = out["step_fall"] / out["tower_share"] if out["tower_share"] > 0 else None
        out["grad_norm_rel_diff"] = abs(off["grad_norm"] - on["grad_norm"]) / max(abs(off["grad_norm"]), 1e-30)
    return out


# ----------------------------------------------------------------------------- output


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _g(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e9:.3f}"


ARM_NAMES = {"off": "reuse off", "on": "reuse on", "text": "text only"}
COLUMNS = (("arm", 10), ("KxRxTxP", 20), ("images", 8), ("distinct", 9), ("patches", 9), ("vision GFLOP/step", 19),
           ("(as run)", 10), ("step s", 10), ("compile s", 10), ("peak MiB", 10), ("grad norm", 11))


def arm_cells(arm: str, a: dict[str, Any]) -> list[str]:
    vision = arm != "text"
    counts = [str(a[k]) if vision else "-" for k in ("images", "distinct_images", "real_patches")]
    return [ARM_NAMES[arm], a["shape"], *counts, _g(a.get("vision_flops")), _g(a.get("vision_flops_as_run")),
            _num(a.get("step_s"), ".3f"), f"{a['compile_s']:.1f}", _mib(a["peak_bytes"]),
            _num(a.get("grad_norm"), ".5g")]


def report(row: dict[str, Any]) -> None:
    s, arms = row["summary"], row["arms"]
    off, on = arms["off"], arms["on"]
    print(f"\n{row['size']} ({row['params']:,} params, {row['compute_dtype']} compute, remat {row['remat']}) / case "
          f"{row['case']}: {row['case_name']}; {row['samples']} samples ({row['prompts']} prompts x "
          f"{row['samples_per_prompt']}), pictures {row['image_grid']}x{row['image_grid']} patches")
    line = lambda cells: "  " + cells[0].ljust(COLUMNS[0][1]) + "".join(  # noqa: E731
        c.rjust(w) for c, (_, w) in zip(cells[1:], COLUMNS[1:]))
    print(line([name for name, _ in COLUMNS]))
    for arm in ARMS:
        if arm in arms:
            print(line(arm_cells(arm, arms[arm])))
    bar = "met" if s["vision_flops_ratio_as_run"] >= 8 else "NOT met"
    print(f"  vision FLOPs off/on: {s['vision_flops_ratio']:.1f}x (flops.py), {s['vision_flops_ratio_as_run']:.1f}x as "
          f"run; encoded patches {s['real_patches_ratio']:.1f}x  (bar >= 8x, as run: {bar})")
    if off["hlo_flops"] is not None and on["hlo_flops"] is not None:
        # XLA counts a loop body once: with one micro-batch (K = 1) its off - on difference is the whole step's.
        print(f"  XLA cost_analysis off - on: {_g(off['hlo_flops'] - on['hlo_flops'])} GFLOP; vision off - on: "
              f"{_g(off['vision_flops'] - on['vision_flops'])} (flops.py), "
              f"{_g(off['vision_flops_as_run'] - on['vision_flops_as_run'])} (as run)"
              + ("" if off["shape"].startswith("1x") else "  [K > 1: XLA counts one micro-batch]"))
    if not row["executed"]:
        print(f"  compiled only: footprint {_mib(off['peak_bytes'])} MiB off, {_mib(on['peak_bytes'])} MiB on")
        return
    text = arms["text"]
    print(f"  step time (median of {len(off['step_s_all'])}): off {off['step_s']:.3f} s, on {on['step_s']:.3f} s, "
          f"text only {text['step_s']:.3f} s")
    print(f"  tower share of the reuse-off step: {100 * s['tower_share']:.1f}%  (off - text only) / off")
    frac = s["fall_over_share"]
    frac_text = "-" if frac is None else f"{100 * frac:.0f}%"
    verdict = "-" if frac is None else ("met" if frac >= 0.7 else "NOT met")
    print(f"  step fall with reuse: {100 * s['step_fall']:.1f}% of the step = {frac_text} of the tower share  "
          f"(bar >= 70%: {verdict})")
    ok = s["grad_norm_rel_diff"] <= GRAD_NORM_RTOL
    print(f"  grad-norm check (first step, same parameters): off {off['grad_norm']:.6g}, on {on['grad_norm']:.6g}, "
          f"relative difference {s['grad_norm_rel_diff']:.1e}  "
          f"{'OK' if ok else 'MISMATCH: the arms do not compute the same thing'}")


def parse_cases(text: str) -> list[int]:
    try:
        cases = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise SystemExit(f"--cases {text!r}: a comma-separated list of {sorted(CASES)}") from None
    unknown = [c for c in cases if c not in CASES]
    if unknown or not cases:
        raise SystemExit(f"--cases {text!r}: choose from {sorted(CASES)}")
    return cases


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=[*SIZES, "all"], default="all",
                   help="all: tiny and small (run) and 2b (compiled only)")
    p.add_argument("--cases", default="1,2", help="comma-separated: 1 geo3k-like, 2 color_reveal-like")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per arm (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per arm after compiling (at least 1)")
    p.add_argument("--prompts", type=int, default=4, help="prompts (GRPO groups) per batch")
    p.add_argument("--samples-per-prompt", type=int, default=16, help="samples per prompt: the copies of its picture")
    p.add_argument("--image-grid", type=int, default=16, help="patches per side of every picture")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per row (the one seq bucket)")
    p.add_argument("--rows", type=int, default=32,
                   help="rows per micro-batch (the one row bucket); 32 of 1024 tokens hold either case")
    p.add_argument("--seed", type=int, default=0, help="seed of the rollouts and the random parameters")
    p.add_argument("--json", default=None, help="also write every number here")
    p.add_argument("--verbose", action="store_true", help="print each compilation as it finishes")
    ns, overrides = p.parse_known_args(argv)
    if ns.repeats < 1 or ns.prompts < 1 or ns.samples_per_prompt < 2:
        raise SystemExit("--repeats and --prompts must be >= 1, --samples-per-prompt >= 2 (a group of one has no "
                         "advantage)")
    sizes = [*SIZES] if ns.size == "all" else [ns.size]
    cases = parse_cases(ns.cases)
    try:  # a mistyped option fails here, before anything compiles
        load_config(None, overrides)
    except ConfigError as e:
        raise SystemExit(f"run-config overrides {' '.join(overrides)}: {e}") from None
    print(f"vision reuse on vs off; {jax.devices()[0].platform} device, {os.cpu_count()} cpus, jax {jax.__version__}; "
          f"rows of {ns.seq_len} tokens, {ns.rows} per micro-batch; overrides {' '.join(overrides) or 'none'}")
    rows, params_cache, ok = [], {}, True
    for size in sizes:
        for case in cases:
            t0 = time.perf_counter()
            row = measure(size, case, ns, overrides, params_cache)
            row["summary"] = summarize(row)
            row["wall_s"] = time.perf_counter() - t0
            report(row)
            print(f"  ({row['wall_s']:.0f} s for this model and case)", flush=True)
            ok &= row["summary"].get("grad_norm_rel_diff", 0.0) <= GRAD_NORM_RTOL
            rows.append(row)
    if ns.json:
        device = jax.devices()[0]
        info = {"platform": device.platform, "device_kind": device.device_kind, "cpus": os.cpu_count(),
                "jax": jax.__version__, "args": vars(ns), "overrides": overrides}
        Path(ns.json).write_text(json.dumps({"info": info, "results": rows}, indent=1, default=str) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
