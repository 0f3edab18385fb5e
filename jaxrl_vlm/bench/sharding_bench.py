"""`jaxrl-vlm bench sharding`: compile the real GRPO train step under each mesh layout and compare them.

Per layout (a `configs/mesh/*.yaml` merged over the run config), on the given devices:
  1. build the mesh and rules; a layout that cannot exist on these devices (sizes that do not divide
     the device count, a batch that cannot be split) is reported as `unbuildable`;
  2. build the synthetic multi-turn batch through the real `build_train_batch` (same buckets and the
     same samples for every layout; rows padded to the layout's batch-shard multiple);
  3. AOT-compile `train_step` with the trainer's explicit in/out shardings from ABSTRACT state (nothing
     allocated yet) and read `memory_analysis()` (per device: arguments, outputs, aliased = donated state,
     temporaries), `cost_analysis()` and the collectives of the optimized HLO (`bench.hlo`);
  4. if the compiled footprint exceeds the device memory, report `does_not_fit` and stop here: this is how
     the real 2B config is checked before any weights are created;
  5. otherwise place random parameters (made once per run in host memory) into their shardings, shard by
     shard, run warm-up + N steps of the compiled executable and take the median step time.

Numbers: model FLOPs are analytic (`bench.flops`: XLA's cost analysis counts loop bodies once; its number
is reported as `hlo_flops`); MFU divides per-device achieved model FLOP/s by the matmul peak measured in the
same run (`bench.peak`) and, on known accelerators with bf16 compute, by the datasheet peak.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_vlm.batching import BatchingError, TrainBatch, build_train_batch
from jaxrl_vlm.bench import flops as flops_lib
from jaxrl_vlm.bench import hlo
from jaxrl_vlm.bench.peak import device_memory_bytes, known_peak_flops, measure_matmul_peak, peak_bytes_in_use
from jaxrl_vlm.bench.synthetic import episode_shape_for, synthetic_samples
from jaxrl_vlm.config import Config, load_config
from jaxrl_vlm.job.trainer import aggregation_constant, sample_advantages, sequences_bucket
from jaxrl_vlm.job.trainer import step_config as learner_step_config
from jaxrl_vlm.models.config import ModelConfig, preset_config
from jaxrl_vlm.models.hf_io import model_class, param_count
from jaxrl_vlm.rl.train_step import TrainState, make_optimizer, train_step
from jaxrl_vlm.sharding.activations import ActivationSharding
from jaxrl_vlm.sharding.layout import (
    batch_shardings,
    build_mesh,
    param_bytes_per_device,
    param_shardings,
    row_multiple,
    state_shardings,
)
from jaxrl_vlm.sharding.rules import MESH_AXES, Rules, ShardingError, resolve_rules
from jaxrl_vlm.tiny import tiny_model_config
from rollout.processing import frame_patches
from rollout.sample import Sample

logger = logging.getLogger(__name__)

# Layout status values.
OK, COMPILED, DOES_NOT_FIT, UNBUILDABLE, OOM = "ok", "compiled", "does_not_fit", "unbuildable", "oom"

# The documented columns of the table / CSV / JSON rows, in order (units in the names).
COLUMNS: tuple[str, ...] = (
    "layout",  # mesh YAML stem
    "status",  # ok | compiled (--compile-only) | does_not_fit | unbuildable | oom
    "reason",  # why a layout was not run
    "mesh",  # "data=1,fsdp=8,expert=1,context=1,tensor=1"
    "devices",
    "model",
    "batch_shape",  # KxRxTxP: micro-batches, rows, tokens per row, patches per micro-batch
    "slots",  # K*R*T token slots of the step
    "real_tokens",
    "compile_s",
    "step_ms",  # median after warm-up
    "step_ms_min",
    "tokens_per_s",  # real tokens / median step time
    "param_bytes",  # parameters held by one device
    "arg_bytes",  # memory_analysis, per device
    "out_bytes",
    "alias_bytes",  # outputs written in place of donated arguments (the train state)
    "temp_bytes",
    "peak_bytes",  # arg + out - alias + temp: the compiled program's footprint on one device
    "device_bytes",  # memory one device may use
    "fits",
    "measured_peak_bytes",  # allocator high-water mark after the run (accelerators; process-wide so far)
    "model_flops",  # analytic FLOPs of one step, whole batch
    "hlo_flops",  # cost_analysis()["flops"], per device, loop bodies counted once
    "tflops_per_device",  # model_flops / devices / step time
    "peak_tflops_measured",
    "mfu",  # tflops_per_device / peak_tflops_measured
    "peak_tflops_known",
    "mfu_known",
    "all_gather_bytes",  # per device per step, result-shape bytes x executions
    "reduce_scatter_bytes",
    "all_reduce_bytes",
    "all_to_all_bytes",
    "collective_permute_bytes",
    "collective_bytes",
    "collective_bytes_by_axis",  # "fsdp=123;tensor=45"
    "loss",  # loss of the last step (layouts must agree; ~0 when old log-probs are the current ones)
    "grad_norm",  # gradient norm of the last step (layouts must agree)
)
_KIND_COLUMN = {k: k.replace("-", "_") + "_bytes" for k in hlo.COLLECTIVE_KINDS}


@dataclass(frozen=True)
class BenchOptions:
    """What to benchmark; the run config supplies the step (loss, optimizer, dtypes, remat, chunking)."""

    model: str = "tiny"  # one of flops.MODEL_SHAPES
    rows: int = 8  # rows per batch (R x K); a multiple of every layout's batch-shard count
    seq_len: int = 512  # tokens per row (the single seq bucket)
    fill: float = 0.8  # synthetic tokens / (rows * seq_len)
    steps: int = 3
    warmup: int = 1
    seed: int = 0
    compile_only: bool = False
    device_memory_bytes: int | None = None  # override of the per-device memory (planning for another device)
    measure_peak: bool = True

    def __post_init__(self) -> None:
        if self.model not in flops_lib.MODEL_SHAPES:
            raise ValueError(f"model={self.model!r}: choose one of {flops_lib.MODEL_SHAPES}")
        if self.rows < 1 or self.seq_len < 16 or not 0 < self.fill <= 1 or self.steps < 1 or self.warmup < 0:
            raise ValueError(f"invalid bench options: rows={self.rows} seq_len={self.seq_len} fill={self.fill} "
                             f"steps={self.steps} warmup={self.warmup}")


@dataclass
class LayoutResult:
    """One row of the report; fields are COLUMNS (None = not measured)."""

    layout: str
    status: str
    reason: str = ""
    mesh: str = ""
    devices: int = 0
    model: str = ""
    batch_shape: str = ""
    slots: int | None = None
    real_tokens: int | None = None
    compile_s: float | None = None
    step_ms: float | None = None
    step_ms_min: float | None = None
    tokens_per_s: float | None = None
    param_bytes: int | None = None
    arg_bytes: int | None = None
    out_bytes: int | None = None
    alias_bytes: int | None = None
    temp_bytes: int | None = None
    peak_bytes: int | None = None
    device_bytes: int | None = None
    fits: bool | None = None
    measured_peak_bytes: int | None = None
    model_flops: float | None = None
    hlo_flops: float | None = None
    tflops_per_device: float | None = None
    peak_tflops_measured: float | None = None
    mfu: float | None = None
    peak_tflops_known: float | None = None
    mfu_known: float | None = None
    all_gather_bytes: int | None = None
    reduce_scatter_bytes: int | None = None
    all_reduce_bytes: int | None = None
    all_to_all_bytes: int | None = None
    collective_permute_bytes: int | None = None
    collective_bytes: int | None = None
    collective_bytes_by_axis: str = ""
    loss: float | None = None
    grad_norm: float | None = None
    # Not a column: the full nested collective breakdown (JSON only).
    collectives: dict[str, Any] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        return {c: getattr(self, c) for c in COLUMNS}


@dataclass
class BenchReport:
    """All layouts of one run plus the facts they share (device, model, batch, peaks)."""

    results: list[LayoutResult]
    info: dict[str, Any]


def model_config(name: str) -> ModelConfig:
    """The config of `--model NAME` (one of `flops.MODEL_SHAPES`): `tiny` / `tiny_qwen2_5_vl` / `tiny_qwen3_vl_moe`
    (the make-tiny models) or an architecture preset of `jaxrl_vlm.models.config` (`small`, `qwen3_vl_2b`, `qwen2_5_vl_3b`)."""
    if name in flops_lib.TINY_SHAPES:
        return tiny_model_config(arch=flops_lib.TINY_SHAPES[name])
    if name not in flops_lib.MODEL_SHAPES:
        raise ValueError(f"unknown model shape {name!r}; choose one of {flops_lib.MODEL_SHAPES}")
    return preset_config(name)


# ----------------------------------------------------------------------------- state without a checkpoint


def _model_kwargs(cfg: Config) -> dict[str, Any]:
    return dict(
        param_dtype=jnp.dtype(cfg.model.param_dtype),
        compute_dtype=jnp.dtype(cfg.model.compute_dtype),
        remat=cfg.model.remat,
        attention_impl=cfg.model.attention_impl,
    )


def opt_state_shardings(opt_state: Any, params: Any, param_sh: Any, mesh: jax.sharding.Mesh, rules: Any) -> Any:
    """Optimizer-state shardings: moments (nnx.State trees shaped like the parameters, names copied by
    optax's tree_map) shard like their parameters; counters and other plain leaves are replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    params_def = jax.tree.structure(params)

    def one(x: Any) -> Any:
        if not isinstance(x, nnx.State):
            return replicated
        return param_sh if jax.tree.structure(x) == params_def else state_shardings(x, mesh, rules)

    return jax.tree.map(one, opt_state, is_leaf=lambda x: isinstance(x, nnx.State))


@dataclass
class StatePlan:
    """The train state of a random-init policy, abstract (shapes) and as shardings; nothing allocated."""

    graphdef: Any
    abstract: Any  # TrainState of ShapeDtypeStructs
    shardings: Any  # TrainState of NamedShardings
    tx: Any


def plan_state(model_cfg: ModelConfig, cfg: Config, mesh: jax.sharding.Mesh, rules: Any,
               patch_attention_block: int | None = None) -> StatePlan:
    """Abstract TrainState + its shardings (params by the rules, Adam moments like params, rest replicated).

    Same layout as `Trainer.build_policy`, built from shapes so a layout can be compiled and sized before
    any memory is used (the trainer loads a checkpoint instead). `patch_attention_block`: as the trainer's
    (`frame_patch_cap`), the most patches of one image frame; None: the vision attention is dense over a
    micro-batch's patches.
    """
    kwargs = _model_kwargs(cfg)
    cls = model_class(model_cfg)
    abstract_model = nnx.eval_shape(lambda: cls(model_cfg, rngs=nnx.Rngs(0), patch_attention_block=patch_attention_block,
                                                **kwargs))
    graphdef, params = nnx.split(abstract_model, nnx.Param)
    tx = make_optimizer(cfg.optim, cfg.rollout.num_rollout * cfg.train.num_steps_per_rollout)
    opt = jax.eval_shape(tx.init, params)
    replicated = NamedSharding(mesh, PartitionSpec())
    rng = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
    abstract = TrainState(params=params, opt_state=opt, step=jax.ShapeDtypeStruct((), jnp.int32), rng=rng)
    p_sh = param_shardings(params, mesh, rules)
    shardings = TrainState(
        params=p_sh,
        opt_state=opt_state_shardings(opt, params, p_sh, mesh, rules),
        step=replicated,
        rng=replicated,
    )
    return StatePlan(graphdef, abstract, shardings, tx)


def host_params(abstract_params: Any, seed: int) -> Any:
    """Random parameters in host memory, in the structure of `abstract_params` (an nnx.State).

    The model's own init values (`models.layers.param`): norm scales 1, biases 0, every other weight N(0, 0.02).
    Built with numpy once per run and shared by all layouts: a jitted init compiles one RNG program per
    parameter (seconds on CPU, per layout), while this costs only host time proportional to the size.
    """
    rng = np.random.default_rng(seed)

    def one(path: tuple, leaf: jax.ShapeDtypeStruct) -> np.ndarray:
        name = str(getattr(path[-1], "key", getattr(path[-1], "name", path[-1])))
        if name == "value" and len(path) > 1:  # an nnx.Variable's value field
            name = str(getattr(path[-2], "key", getattr(path[-2], "name", path[-2])))
        if name == "scale":
            value = np.ones(leaf.shape, np.float32)
        elif name == "bias" or "_bias_" in name:
            value = np.zeros(leaf.shape, np.float32)
        else:
            value = rng.standard_normal(leaf.shape, dtype=np.float32) * np.float32(0.02)
        return value.astype(leaf.dtype)

    return jax.tree_util.tree_map_with_path(one, abstract_params)


def init_state(plan: StatePlan, params_on_host: Any, seed: int) -> Any:
    """TrainState on the mesh: host parameters sent shard by shard to their devices (never whole on one
    device), Adam moments created in place by a jitted `tx.init` with the planned output shardings."""
    params = jax.device_put(params_on_host, plan.shardings.params)
    opt_state = jax.jit(plan.tx.init, out_shardings=plan.shardings.opt_state)(params)
    step = jax.device_put(np.zeros((), np.int32), plan.shardings.step)
    rng = jax.device_put(np.asarray(jax.random.key_data(jax.random.key(seed))), plan.shardings.rng)
    return TrainState(params=params, opt_state=opt_state, step=step, rng=rng)


# ----------------------------------------------------------------------------- batch


def bench_samples(model_cfg: ModelConfig, opts: BenchOptions, packing: bool) -> list[Sample]:
    """The synthetic episodes every layout trains on (deterministic in `opts.seed`)."""
    shape = episode_shape_for(opts.seq_len, model_cfg)
    budget = int(opts.rows * opts.seq_len * opts.fill)
    return synthetic_samples(model_cfg, budget, shape=shape, seed=opts.seed, max_samples=None if packing else opts.rows)


def largest_frame(samples: list[Sample]) -> int | None:
    """Patches of the largest image frame among the samples (None: no image). The trainer bounds its vision
    attention by the image processor's cap (`job.trainer.frame_patch_cap`); the bench's synthetic images have
    no processor, so their own largest frame is that cap: a processor whose pixel cap is that frame would make
    the same images, and the bench then compiles the frame-local vision attention the trainer runs."""
    grids = [s.multimodal_train_inputs.get("image_grid_thw") for s in samples if s.multimodal_train_inputs]
    frames = [int(frame_patches(g).max()) for g in grids if g is not None and len(g)]
    return max(frames) if frames else None


def bench_batch(samples: list[Sample], model_cfg: ModelConfig, cfg: Config, opts: BenchOptions, multiple: int) -> TrainBatch:
    """The fixed-shape batch: one seq bucket (`seq_len`), one row bucket (`rows`), patch buckets in steps of 256."""
    unit = 64 * model_cfg.vision.merge_unit
    total = sum(int(np.prod(s.multimodal_train_inputs["image_grid_thw"], axis=1).sum()) for s in samples)
    patch_buckets = [0, *range(unit, -(-total // unit) * unit + unit, unit)]
    return build_train_batch(
        samples,
        sample_advantages(samples, cfg).astype(np.float32),
        model_cfg,
        seq_buckets=[opts.seq_len],
        row_buckets=[opts.rows],
        patch_buckets=patch_buckets,
        packing=cfg.batching.packing,
        micro_batch_rows=cfg.train.micro_batch_size,
        row_multiple=multiple,
        aggregation=cfg.algo.loss_aggregation,
        aggregation_constant=aggregation_constant(cfg),
        overlong_policy="truncate",
        vision_reuse=cfg.batching.vision_reuse,  # the run's layout, so model_flops count the tower work it does
    )


def step_config(cfg: Config, batch: TrainBatch, mesh: jax.sharding.Mesh, rules: Rules) -> Any:
    """The trainer's StepConfig for this batch (the learner's own function, so the bench times the real step)."""
    return learner_step_config(
        cfg, sequences_bucket(batch.layout.max_sequences_per_micro_batch),
        old_from_current=cfg.train.num_steps_per_rollout == 1,
        activations=ActivationSharding.from_config(cfg.mesh, mesh, rules),
    )


# ----------------------------------------------------------------------------- one layout


def _mesh_text(mesh: jax.sharding.Mesh) -> str:
    return ",".join(f"{a}={mesh.shape[a]}" for a in MESH_AXES)


def _is_oom(err: Exception) -> bool:
    text = str(err)
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text


def _memory(compiled: Any, res: LayoutResult) -> None:
    mem = compiled.memory_analysis()
    if mem is None:
        return
    res.arg_bytes = int(mem.argument_size_in_bytes)
    res.out_bytes = int(mem.output_size_in_bytes)
    res.alias_bytes = int(mem.alias_size_in_bytes)
    res.temp_bytes = int(mem.temp_size_in_bytes)
    res.peak_bytes = res.arg_bytes + res.out_bytes - res.alias_bytes + res.temp_bytes


def _hlo_flops(compiled: Any) -> float | None:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    if not cost or "flops" not in cost:
        return None
    return float(cost["flops"])


def _collectives(compiled: Any, mesh: jax.sharding.Mesh, res: LayoutResult) -> None:
    summary = hlo.collective_summary(compiled.as_text(), MESH_AXES, [mesh.shape[a] for a in MESH_AXES])
    for kind, col in _KIND_COLUMN.items():
        setattr(res, col, summary.bytes_by_kind[kind])
    res.collective_bytes = summary.total_bytes
    res.collective_bytes_by_axis = ";".join(f"{a}={b}" for a, b in sorted(summary.bytes_by_axis.items()))
    res.collectives = {
        "bytes_by_kind_axis": summary.bytes_by_kind_axis,
        "executions_by_kind": summary.count_by_kind,
        "unknown_trip_counts": summary.unknown_trip_counts,
        "top": [
            {"kind": c.kind, "axes": c.axes, "bytes": c.total_bytes, "executions": c.executions, "op_name": c.op_name}
            for c in summary.top
        ],
    }


def bench_layout(
    layout: str,
    cfg: Config,
    model_cfg: ModelConfig,
    samples: list[Sample],
    opts: BenchOptions,
    devices: Sequence[Any],
    peaks: dict[str, float | None],
    params_cache: dict[str, Any] | None = None,
) -> LayoutResult:
    """Compile, size and (when it fits) run the train step under one layout; never raises for a layout
    that cannot be built or does not fit, only for bugs. `params_cache` shares the host parameters between
    layouts of one run (they depend only on the model shape, dtype and seed)."""
    res = LayoutResult(layout=Path(layout).stem, status=UNBUILDABLE, devices=len(devices), model=opts.model)
    try:
        mesh = build_mesh(cfg.mesh, devices)
        rules = resolve_rules(cfg.mesh.sharding_rules, f"{layout}: sharding_rules")
        res.mesh = _mesh_text(mesh)
        batch = bench_batch(samples, model_cfg, cfg, opts, row_multiple(mesh, rules))
        b_sh = batch_shardings(batch.arrays, mesh, rules)
    except (ShardingError, BatchingError) as e:
        res.reason = str(e)
        logger.info("layout %s: unbuildable: %s", res.layout, e)
        return res
    k, r, t, p = batch.shape_key
    res.batch_shape = f"{k}x{r}x{t}x{p}"
    res.slots = batch.layout.slots
    res.real_tokens = batch.layout.real_tokens
    res.model_flops = flops_lib.train_step_flops(model_cfg, batch.shape_key)

    plan = plan_state(model_cfg, cfg, mesh, rules, patch_attention_block=largest_frame(samples))
    res.param_bytes = param_bytes_per_device(plan.abstract.params, mesh, rules)
    fn = partial(train_step, plan.graphdef, plan.tx, step_config(cfg, batch, mesh, rules))
    jitted = jax.jit(fn, in_shardings=(plan.shardings, b_sh, None, None), out_shardings=(plan.shardings, None), donate_argnums=(0,))
    abstract_batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch.arrays)
    t0 = time.perf_counter()
    try:
        compiled = jitted.lower(plan.abstract, abstract_batch, None, None).compile()
    except jax.errors.JaxRuntimeError as e:
        if not _is_oom(e):
            raise
        res.status, res.reason = DOES_NOT_FIT, f"compiler: {str(e).splitlines()[0]}"
        return res
    res.compile_s = time.perf_counter() - t0
    _memory(compiled, res)
    res.hlo_flops = _hlo_flops(compiled)
    _collectives(compiled, mesh, res)
    res.device_bytes = opts.device_memory_bytes or device_memory_bytes(devices[0])[0]
    res.fits = res.peak_bytes is None or res.peak_bytes <= res.device_bytes
    if not res.fits:
        res.status = DOES_NOT_FIT
        res.reason = f"compiled footprint {_gib(res.peak_bytes)} per device > {_gib(res.device_bytes)} available"
        return res
    if opts.compile_only:
        res.status = COMPILED
        return res

    try:
        cache = {} if params_cache is None else params_cache
        key = f"{opts.model}/{cfg.model.param_dtype}/{opts.seed}"
        if key not in cache:
            cache.clear()
            cache[key] = host_params(plan.abstract.params, opts.seed)
        state = init_state(plan, cache[key], opts.seed)
        device_batch = jax.device_put(batch.arrays, b_sh)
        times = []
        metrics = None
        for i in range(opts.warmup + opts.steps):
            t0 = time.perf_counter()
            state, metrics = compiled(state, device_batch, None, None)
            jax.block_until_ready((state, metrics))
            if i >= opts.warmup:
                times.append(time.perf_counter() - t0)
    except jax.errors.JaxRuntimeError as e:
        if not _is_oom(e):
            raise
        res.status, res.reason = OOM, str(e).splitlines()[0]
        return res
    res.status = OK
    res.loss = float(metrics["train/loss_total"])
    res.grad_norm = float(metrics["train/grad_norm"])
    step_s = statistics.median(times)
    res.step_ms, res.step_ms_min = 1e3 * step_s, 1e3 * min(times)
    res.tokens_per_s = res.real_tokens / step_s
    res.measured_peak_bytes = peak_bytes_in_use(devices[0])
    achieved = res.model_flops / len(devices) / step_s
    res.tflops_per_device = achieved / 1e12
    if peaks.get("measured"):
        res.peak_tflops_measured = peaks["measured"] / 1e12
        res.mfu = achieved / peaks["measured"]
    if peaks.get("known"):
        res.peak_tflops_known = peaks["known"] / 1e12
        res.mfu_known = achieved / peaks["known"]
    del state, device_batch
    return res


# ----------------------------------------------------------------------------- the run


def run_sharding_bench(
    config_path: str | None,
    layouts: Sequence[str],
    opts: BenchOptions,
    *,
    overrides: Sequence[str] = (),
    devices: Sequence[Any] | None = None,
    on_result: Callable[[LayoutResult], None] | None = None,
    context_sizes: Sequence[int] | None = None,
) -> BenchReport:
    """Benchmark every layout (mesh YAML paths) on `devices` (default: all) with one model, batch and step.

    `context_sizes`: run each layout once per context-parallel size N (`--mesh-context N`, reported as
    `LAYOUT@cpN`) on the first N x (its other fixed axis sizes) devices, its fill axis then being 1: how one
    row's per-device memory falls as its positions are split over more devices."""
    if not layouts:
        raise ValueError("no layouts given (pass mesh YAML files, e.g. configs/mesh/*.yaml)")
    devices = list(jax.devices() if devices is None else devices)
    base = load_config(config_path, list(overrides))
    model_cfg = model_config(opts.model)
    samples = bench_samples(model_cfg, opts, base.batching.packing)
    peaks: dict[str, float | None] = {"measured": None, "known": known_peak_flops(devices[0], base.model.compute_dtype)}
    if opts.measure_peak and not opts.compile_only:
        peaks["measured"] = measure_matmul_peak(devices[0], base.model.compute_dtype)
    device_bytes, device_bytes_source = device_memory_bytes(devices[0])
    info: dict[str, Any] = {
        "config": config_path,
        "overrides": list(overrides),
        "model": opts.model,
        "params": param_count(model_cfg),
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "devices": len(devices),
        "jax": jax.__version__,
        "param_dtype": base.model.param_dtype,
        "compute_dtype": base.model.compute_dtype,
        "remat": base.model.remat,
        "attention_impl": base.model.attention_impl,
        "samples": len(samples),
        "sample_tokens": sum(len(s.tokens) for s in samples),
        "rows": opts.rows,
        "seq_len": opts.seq_len,
        "steps": opts.steps,
        "warmup": opts.warmup,
        "peak_tflops_measured": None if peaks["measured"] is None else peaks["measured"] / 1e12,
        "peak_tflops_known": None if peaks["known"] is None else peaks["known"] / 1e12,
        "device_bytes": opts.device_memory_bytes or device_bytes,
        "device_bytes_source": "override" if opts.device_memory_bytes else device_bytes_source,
        "options": dataclasses.asdict(opts),
    }
    results = []
    params_cache: dict[str, Any] = {}
    for layout in layouts:
        for cp in context_sizes or (None,):
            extra = [] if cp is None else ["--mesh-context", str(cp)]
            cfg = load_config(config_path, [*overrides, "--mesh-config", str(layout), *extra])
            name, devs = str(layout), devices
            if cp is not None:
                fixed = math.prod(max(1, v) for v in (cfg.mesh.mesh_data, cfg.mesh.mesh_fsdp, cfg.mesh.mesh_expert,
                                                      cfg.mesh.mesh_tensor))
                name, devs = f"{Path(layout).stem}@cp{cp}", devices[: cp * fixed]
            logger.info("layout %s: compiling on %d %s device(s)", Path(name).stem, len(devs), devices[0].platform)
            res = bench_layout(name, cfg, model_cfg, samples, opts, devs, peaks, params_cache)
            results.append(res)
        if on_result is not None:
            on_result(res)
    return BenchReport(results, info)


# ----------------------------------------------------------------------------- outputs


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def format_table(report: BenchReport) -> str:
    """Fixed-width table of the main columns (all columns are in the CSV/JSON)."""
    head = ["layout", "mesh", "status", "step ms", "tok/s", "mem/dev MiB", "fits", "TFLOP/s/dev", "MFU",
            "AG MiB", "RS MiB", "AR MiB", "A2A MiB", "CP MiB", "grad norm"]  # fmt: skip
    rows = []
    for r in report.results:
        rows.append([
            r.layout, r.mesh or "-", r.status, _num(r.step_ms, ".1f"), _num(r.tokens_per_s, ".0f"),
            _mib(r.peak_bytes), "-" if r.fits is None else ("yes" if r.fits else "NO"),
            _num(r.tflops_per_device, ".3f"), "-" if r.mfu is None else f"{100 * r.mfu:.1f}%",
            _mib(r.all_gather_bytes), _mib(r.reduce_scatter_bytes), _mib(r.all_reduce_bytes),
            _mib(r.all_to_all_bytes), _mib(r.collective_permute_bytes), _num(r.grad_norm, ".5g"),
        ])  # fmt: skip
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    out = [line(head), line(["-" * w for w in widths])] + [line(row) for row in rows]
    i = report.info
    out.insert(0, (
        f"model {i['model']} ({i['params'] / 1e6:.1f}M params, {i['param_dtype']} params, {i['compute_dtype']} compute, "
        f"remat {i['remat']}, {i.get('attention_impl', 'xla')} attention) on {i['devices']} x {i['device_kind']}; {i['samples']} synthetic episodes, "
        f"{i['rows']} rows x {i['seq_len']} tokens; matmul peak {_num(i['peak_tflops_measured'], '.3f')} TFLOP/s/dev measured"
        + (f", {i['peak_tflops_known']:.0f} datasheet" if i.get("peak_tflops_known") else "")
    ))
    notes = [f"  {r.layout}: {r.reason}" for r in report.results if r.reason]
    if notes:
        out += ["", "not run:", *notes]
    return "\n".join(out)


def format_context_table(reports: Sequence[BenchReport]) -> str:
    """Per-device compiled memory by row length (one report each) and context-parallel size (`LAYOUT@cpN` rows):
    temporaries (activations, the part context parallelism splits) and the whole peak, with the ratio of the
    smallest size's temporaries to each."""
    lines = ["per-device memory by tokens per row and context-parallel size (temporaries = activations; ratio = "
             "temporaries at the smallest size / at this size)"]
    for report in reports:
        rows = [r for r in report.results if "@cp" in r.layout]
        base = next((r.temp_bytes for r in rows if r.temp_bytes), None)
        for r in rows:
            ratio = "-" if not (base and r.temp_bytes) else f"{base / r.temp_bytes:.2f}x"
            lines.append(f"  {report.info['seq_len']:>7} tokens  {r.layout:<16} {r.status:<12} temporaries "
                         f"{_mib(r.temp_bytes):>10} MiB  peak {_mib(r.peak_bytes):>10} MiB  ratio {ratio}")
    return "\n".join(lines)


def write_csv(report: BenchReport, path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(COLUMNS))
        writer.writeheader()
        for r in report.results:
            writer.writerow({k: "" if v is None else v for k, v in r.row().items()})


def write_json(report: BenchReport, path: Path) -> None:
    data = {
        "info": report.info,
        "columns": list(COLUMNS),
        "results": [{**r.row(), "collectives": r.collectives} for r in report.results],
    }
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")


def write_chart(report: BenchReport, path: Path) -> None:
    """Four panels per layout: step time, per-device memory (vs the device's), collective bytes by kind, MFU."""
    import matplotlib  # optional plotting dependency, only needed for the chart

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = report.results
    names = [r.layout for r in res]
    x = np.arange(len(res))
    fig, axes = plt.subplots(2, 2, figsize=(max(8, 2.2 * len(res) + 4), 7.5))
    (ax_t, ax_m), (ax_c, ax_u) = axes

    def mark_missing(ax, values):
        for i, (r, v) in enumerate(zip(res, values)):
            if v is None:
                ax.text(i, 0, r.status, rotation=90, ha="center", va="bottom", fontsize=8, color="firebrick")

    steps = [r.step_ms for r in res]
    ax_t.bar(x, [v or 0 for v in steps], color="tab:blue")
    mark_missing(ax_t, steps)
    ax_t.set_title("step time (median, ms)")

    bottom = np.zeros(len(res))
    for label, key in (("arguments", "arg_bytes"), ("temporaries", "temp_bytes")):
        vals = np.array([(getattr(r, key) or 0) / 2**30 for r in res])
        ax_m.bar(x, vals, bottom=bottom, label=label)
        bottom += vals
    outs = np.array([((r.out_bytes or 0) - (r.alias_bytes or 0)) / 2**30 for r in res])
    ax_m.bar(x, outs, bottom=bottom, label="outputs (not aliased)")
    dev = report.info.get("device_bytes")
    if dev and max(bottom + outs, default=0) > 0.05 * dev / 2**30:
        ax_m.axhline(dev / 2**30, color="k", ls="--", lw=1, label="device memory")
    mark_missing(ax_m, [r.peak_bytes for r in res])
    ax_m.set_title("compiled memory per device (GiB)")
    ax_m.legend(fontsize=7)

    bottom = np.zeros(len(res))
    for kind, col in _KIND_COLUMN.items():
        vals = np.array([(getattr(r, col) or 0) / 2**20 for r in res])
        if vals.any():
            ax_c.bar(x, vals, bottom=bottom, label=kind)
            bottom += vals
    mark_missing(ax_c, [r.collective_bytes for r in res])
    ax_c.set_title("collective bytes per device per step (MiB)")
    if bottom.any():
        ax_c.legend(fontsize=7)

    mfu = [None if r.mfu is None else 100 * r.mfu for r in res]
    ax_u.bar(x, [v or 0 for v in mfu], color="tab:green")
    mark_missing(ax_u, mfu)
    ax_u.set_title("MFU vs measured matmul peak (%)")
    for ax in axes.flat:
        ax.set_xticks(x, names)
    i = report.info
    fig.suptitle(f"{i['model']} on {i['devices']} x {i['device_kind']} ({i['rows']} rows x {i['seq_len']} tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(report: BenchReport, out_dir: str | Path, stem: str = "sharding_bench") -> dict[str, Path]:
    """CSV, JSON, PNG and the text table under `out_dir`; returns their paths by kind."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out / f"{stem}.csv", "json": out / f"{stem}.json", "png": out / f"{stem}.png", "txt": out / f"{stem}.txt"}
    write_csv(report, paths["csv"])
    write_json(report, paths["json"])
    write_chart(report, paths["png"])
    paths["txt"].write_text(format_table(report) + "\n")
    return paths
