"""The main job: rollout -> advantages -> batching -> train step -> weight sync -> metrics, for --num-rollout steps.

Synchronous on purpose (like slime's `train.py`): rollout k+1 starts after the weights of step k reached the
engine, so every sample is on-policy up to the recorded `weight_versions`. The engine is the embedded JAX
engine unless `--engine-url` points at SGLang (or a router).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_vlm.config import Config
from rollout.sample import Sample

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------- assets
def prepare_assets(cfg: Config) -> tuple[Path, Path]:
    """The model directory and the prompt data, created on first use when the config asks for it."""
    if not cfg.model.hf_checkpoint:
        raise ValueError("--hf-checkpoint is required (a Qwen3-VL HF directory, or a path for --make-tiny to create)")
    model_dir = Path(cfg.model.hf_checkpoint)
    if not (model_dir / "config.json").exists():
        if not cfg.model.make_tiny:
            raise FileNotFoundError(f"--hf-checkpoint {model_dir}: no config.json (set --make-tiny to create a tiny random model)")
        from jaxrl_vlm.tiny import make_tiny

        logger.info("creating a tiny random Qwen3-VL at %s", model_dir)
        make_tiny(str(model_dir), seed=cfg.train.seed)
    if not cfg.data.prompt_data:
        raise ValueError("--prompt-data is required (parquet or jsonl in the Geometry3K layout)")
    data_path = Path(cfg.data.prompt_data)
    if not data_path.exists():
        if not cfg.data.make_data:
            raise FileNotFoundError(f"--prompt-data {data_path} does not exist (set --make-data to generate synthetic geo3k)")
        from jaxrl_vlm.data.synthetic import make_dataset

        logger.info("generating %d synthetic geo3k rows at %s", cfg.data.synthetic_rows, data_path)
        data_path.parent.mkdir(parents=True, exist_ok=True)
        make_dataset(str(data_path), cfg.data.synthetic_rows, seed=cfg.train.seed, image_size=cfg.data.synthetic_image_size)
    return model_dir, data_path


def loss_config(cfg: Config, num_sequences: int) -> Any:
    from jaxrl_vlm.rl.losses import LossConfig

    a = cfg.algo
    return LossConfig(
        eps_clip=a.eps_clip,
        eps_clip_high=a.eps_clip_high,
        eps_clip_c=a.eps_clip_c,
        use_tis=a.use_tis,
        tis_clip=a.tis_clip,
        tis_clip_low=a.tis_clip_low,
        use_kl_loss=a.use_kl_loss,
        kl_loss_coef=a.kl_loss_coef,
        kl_loss_type=a.kl_loss_type,
        entropy_coef=a.entropy_coef,
        num_sequences=num_sequences,
        aggregation=a.loss_aggregation,
        aggregation_constant=aggregation_constant(cfg),
    )


def aggregation_constant(cfg: Config) -> float | None:
    """Dr.GRPO's divisor: the configured constant, else the response budget (as the option's help says)."""
    if cfg.algo.loss_aggregation != "seq_mean_token_sum_norm":
        return cfg.algo.loss_aggregation_constant
    return cfg.algo.loss_aggregation_constant or float(cfg.rollout.rollout_max_response_len)


def sequences_bucket(n: int) -> int:
    """Static bound on sequences per micro-batch, rounded up to a power of two so it rarely recompiles."""
    return 1 << max(0, int(n) - 1).bit_length()


def sample_advantages(samples: list[Sample], cfg: Config) -> np.ndarray:
    from jaxrl_vlm.rl.advantages import compute_advantages

    rewards = np.array([float(s.reward) for s in samples], np.float64)
    groups = np.array([s.group_index for s in samples], np.int64)
    return compute_advantages(
        rewards, groups, cfg.algo.advantage_estimator, std_normalization=not cfg.algo.disable_grpo_std_normalization
    )


@contextlib.asynccontextmanager
async def rollout_session(cfg: Config, model_dir: Path, serve_dir: Path, args: Any, weight_version: str = "default"):
    """Engine (embedded unless --engine-url), client and rollout context; everything stopped on exit.

    Yields the SGLangClient; `args.rollout_context` is set for the episode functions. `serve_dir` holds the
    weights the embedded engine starts from (the resumed version after `--load`, labelled `weight_version`).
    """
    from rollout.client import RetryPolicy, SGLangClient
    from rollout.driver import close_suspended
    from rollout.encoding import ChatEncoder
    from rollout.loading import load_module
    from rollout.multiturn import RolloutContext
    from rollout.processing import load_image_processor, load_tokenizer

    engine = None
    launched = None
    client: SGLangClient | None = None
    client_options = dict(timeout_s=cfg.engine.engine_request_timeout, retry=RetryPolicy(max_retries=cfg.engine.engine_max_retries))
    try:
        if cfg.engine.engine_url:
            client = SGLangClient(cfg.engine.engine_url, worker_urls=cfg.engine.engine_worker_urls or None, **client_options)
        elif cfg.engine.launch_sglang:
            from jaxrl_vlm.sglang_launcher import SGLangProcess

            launched = SGLangProcess(
                cfg.engine.sglang_python or "", str(serve_dir), host=cfg.engine.engine_host, port=cfg.engine.engine_port,
                extra_args=cfg.engine.sglang_args, log_path=Path(cfg.train.output_dir) / "sglang.log",
            )
            client = SGLangClient(launched.start(), **client_options)
            await launched.wait_ready(client, timeout_s=cfg.engine.engine_start_timeout)
        else:
            from jaxrl_vlm.engine import EmbeddedEngine
            from jaxrl_vlm.engine.config import EngineConfig

            engine_cfg = EngineConfig(
                max_batch=cfg.engine.engine_max_batch, max_seq_len=cfg.engine.engine_max_seq_len,
                param_dtype=cfg.model.param_dtype, compute_dtype=cfg.model.compute_dtype, seed=cfg.rollout.rollout_seed,
                prefix_cache=cfg.engine.engine_prefix_cache,
            )
            engine = EmbeddedEngine(str(serve_dir), host=cfg.engine.engine_host, port=cfg.engine.engine_port,
                                    config=engine_cfg, weight_version=weight_version)
            client = SGLangClient(engine.start(), **client_options)
        await client.wait_healthy(timeout_s=cfg.engine.engine_start_timeout)
        encoder = ChatEncoder(load_tokenizer(model_dir), load_image_processor(model_dir))
        env_module = load_module(cfg.rollout.rollout_interaction_env_path, "--rollout-interaction-env-path")
        args.rollout_context = RolloutContext(
            client=client, encoder=encoder, env_module=env_module,
            generate_slots=asyncio.Semaphore(cfg.rollout.sglang_server_concurrency),
            router_mode=bool(cfg.engine.engine_worker_urls),
        )
        yield client
    finally:
        if getattr(args, "rollout_context", None) is not None:
            await close_suspended(args)
        if client is not None:
            await client.close()
        if engine is not None:
            engine.stop()
        if launched is not None:
            launched.stop()


def load_dataset(cfg: Config, data_path: Path) -> Any:
    from jaxrl_vlm.data.geo3k import load_geo3k_dataset, load_prompt_dataset

    d = cfg.data
    common = dict(input_key=d.input_key, label_key=d.label_key, image_key=d.image_key, on_bad_row=d.on_bad_row)
    if d.prompt_style == "plain":
        return load_prompt_dataset(str(data_path), system_prompt=d.system_prompt, **common)
    return load_geo3k_dataset(str(data_path), **common, **({"system_prompt": d.system_prompt} if d.system_prompt else {}))


async def run_one_rollout(cfg: Config, dump_path: str | None = None) -> Any:
    """`jaxrl-vlm rollout`: one rollout step with the checkpoint's weights, optionally dumped for debugging."""
    from jaxrl_vlm.data.geo3k import PromptIterator
    from rollout.loading import load_function

    model_dir, data_path = prepare_assets(cfg)
    prompts = PromptIterator(load_dataset(cfg, data_path), cfg.rollout.rollout_batch_size,
                             shuffle=cfg.data.rollout_shuffle, seed=cfg.train.seed)
    args = cfg.to_namespace()
    async with rollout_session(cfg, model_dir, model_dir, args):
        rollout_fn = load_function(cfg.rollout.rollout_function_path, "--rollout-function-path")
        result = await rollout_fn(args, 0, prompts)
        if dump_path:
            from rollout.dump import dump_samples

            dump_samples([*result.samples, *result.failed], dump_path, args.rollout_context.encoder.tokenizer)
    return result


class Trainer:
    """Owns the run: builds the policy, checkpoints and the rollout session, then runs the loop."""

    def __init__(self, cfg: Config, *, devices: list[Any] | None = None):
        """`devices`: the devices of the training mesh (default: all of them)."""
        self.cfg = cfg
        self.devices = devices
        self.out_dir = Path(cfg.train.output_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._step_fns: dict[int, Any] = {}
        self._logprob_fn = None

    # -------------------------------------------------------------------------- setup
    def build_policy(self, model_dir: Path) -> None:
        from jaxrl_vlm.models.hf_io import from_hf
        from jaxrl_vlm.rl.train_step import TrainState, make_optimizer
        from jaxrl_vlm.sharding import build_mesh, param_shardings, resolve_rules, shardings_for

        cfg = self.cfg
        self.mesh = build_mesh(cfg.mesh, self.devices)
        self.rules = resolve_rules(cfg.mesh.sharding_rules)
        from jaxrl_vlm.models.hf_io import load_hf_config

        placement = shardings_for(self.mesh, self.rules, load_hf_config(str(model_dir)))
        model = from_hf(
            str(model_dir), param_dtype=jnp.dtype(cfg.model.param_dtype), shardings_for=placement,
            compute_dtype=jnp.dtype(cfg.model.compute_dtype), remat=cfg.model.remat != "none",
            attention_impl=cfg.model.attention_impl,
        )
        self.model_cfg = model.cfg
        self.graphdef, params = nnx.split(model, nnx.Param)
        self.tx = make_optimizer(cfg.optim, cfg.rollout.num_rollout * cfg.train.num_steps_per_rollout)
        p_sh = param_shardings(params, self.mesh, self.rules)
        # Optimizer moments are laid out like the parameters they track.
        opt_state = jax.jit(self.tx.init)(params)
        rng = jax.random.key_data(jax.random.key(cfg.train.seed))
        state = TrainState(params=params, opt_state=opt_state, step=jnp.zeros((), jnp.int32), rng=rng)
        # Everything lives on the mesh: parameters (and the optimizer moments jit placed like them) keep
        # their shardings, anything else (step, RNG, Adam's count) is replicated.
        replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())

        def on_mesh(x: jax.Array) -> jax.sharding.Sharding:
            sh = x.sharding
            return sh if isinstance(sh, jax.sharding.NamedSharding) and sh.mesh == self.mesh else replicated

        self.state_shardings = state._replace(params=p_sh, opt_state=jax.tree.map(on_mesh, opt_state),
                                              step=replicated, rng=replicated)
        self.state = jax.device_put(state, self.state_shardings)
        self.ref_params = jax.tree.map(jnp.copy, params) if cfg.algo.use_kl_loss else None

    def _step_fn(self, num_sequences: int, old_from_current: bool):
        from jaxrl_vlm.models.activation_sharding import ActivationSharding
        from jaxrl_vlm.rl.train_step import StepConfig, compile_train_step
        from jaxrl_vlm.sharding import batch_shardings

        key = (num_sequences, old_from_current)
        if key not in self._step_fns:
            cfg = self.cfg
            step_cfg = StepConfig(
                loss_name=cfg.algo.policy_loss, loss=loss_config(cfg, num_sequences),
                logprob_chunk_size=cfg.model.logprob_chunk_size, need_entropy=cfg.algo.entropy_coef > 0,
                old_from_current=old_from_current,
                activations=ActivationSharding.from_config(cfg.mesh, self.mesh, self.rules),
            )
            self._step_fns[key] = compile_train_step(
                self.graphdef, self.tx, step_cfg, state_shardings=self.state_shardings,
                batch_shardings=lambda tree: batch_shardings(tree, self.mesh, self.rules),
            )
        return self._step_fns[key]

    def _logprobs(self, params: Any, device_batch: Any) -> jax.Array:
        from jaxrl_vlm.models.activation_sharding import ActivationSharding
        from jaxrl_vlm.rl.train_step import compute_logprobs

        if self._logprob_fn is None:
            self._logprob_fn = jax.jit(
                compute_logprobs, static_argnums=(0,), static_argnames=("chunk_size", "activations")
            )
        return self._logprob_fn(
            self.graphdef, params, device_batch, chunk_size=self.cfg.model.logprob_chunk_size,
            activations=ActivationSharding.from_config(self.cfg.mesh, self.mesh, self.rules),
        )

    def compiled_programs(self) -> int:
        return sum(len(getattr(f, "cache", {})) for f in self._step_fns.values())

    def _batch(self, samples: list[Sample], advantages: np.ndarray) -> tuple[Any, Any]:
        from jaxrl_vlm.batching import build_train_batch
        from jaxrl_vlm.distributed import global_batch
        from jaxrl_vlm.sharding import row_multiple

        cfg = self.cfg
        batch = build_train_batch(
            samples, advantages.astype(np.float32), self.model_cfg,
            seq_buckets=cfg.batching.seq_buckets, row_buckets=cfg.batching.row_buckets,
            patch_buckets=cfg.batching.patch_buckets, packing=cfg.batching.packing,
            micro_batch_rows=cfg.train.micro_batch_size, row_multiple=row_multiple(self.mesh, self.rules),
            aggregation=cfg.algo.loss_aggregation, aggregation_constant=aggregation_constant(cfg),
            overlong_policy=cfg.batching.overlong_policy,
        )
        # Each process uploads only the rows its devices hold (plain device_put would first gather and compare
        # the whole batch across processes).
        return batch, global_batch(batch.arrays, self.mesh, rules=self.rules)

    # -------------------------------------------------------------------------- one update
    def train_on(self, samples: list[Sample]) -> dict[str, float]:
        """Advantages -> fixed-shape batches -> compiled optimizer steps. One host sync (the metrics) per call.

        Advantages are computed over the whole rollout (grouped by `group_index`). The samples are then cut into
        optimizer batches of `--global-batch-size` (slime's meaning: samples per optimizer step), and each is
        trained `--num-steps-per-rollout` times. With one batch and one step the old log-probs are the current
        policy's own (the ratio is exactly 1, as in slime); otherwise they are computed for every batch with the
        pre-update weights before the first update.
        """
        cfg = self.cfg
        advantages = sample_advantages(samples, cfg)
        size = cfg.train.global_batch_size or len(samples)
        chunks = [(samples[i : i + size], advantages[i : i + size]) for i in range(0, len(samples), size)]
        batches = [self._batch(chunk, adv) for chunk, adv in chunks]
        single = len(batches) == 1 and cfg.train.num_steps_per_rollout == 1
        old = [None if single else self._logprobs(self.state.params, dev) for _, dev in batches]
        ref = [None if self.ref_params is None else self._logprobs(self.ref_params, dev) for _, dev in batches]
        updates = []
        for _ in range(cfg.train.num_steps_per_rollout):
            for (batch, device_batch), old_lp, ref_lp in zip(batches, old, ref):
                step_fn = self._step_fn(sequences_bucket(batch.layout.max_sequences_per_micro_batch), single)
                self.state, step_metrics = step_fn(self.state, device_batch, old_lp, ref_lp)
                updates.append(step_metrics)
        # Metrics of the optimizer steps of this rollout, averaged (one device->host transfer).
        per_step = jax.device_get(updates)
        metrics = {k: float(np.mean([m[k] for m in per_step])) for k in per_step[0]}
        metrics["train/optimizer_steps"] = float(len(per_step))
        metrics["batch/padding_efficiency"] = float(np.mean([b.layout.padding_efficiency for b, _ in batches]))
        metrics["batch/rows_per_micro_batch"] = float(batches[0][0].arrays.tokens.shape[1])
        metrics["batch/real_tokens"] = float(sum(b.layout.real_tokens for b, _ in batches))
        metrics["batch/compiled_programs"] = float(self.compiled_programs())
        metrics["rollout/advantage_abs_mean"] = float(np.abs(advantages).mean())
        return metrics

    def policy_model(self) -> Any:
        return nnx.merge(self.graphdef, self.state.params)

    # -------------------------------------------------------------------------- loop
    async def run(self) -> dict[str, Any]:
        """The whole job. With several processes, process 0 runs the rollout (and logs, plots, talks to the
        engine); every process trains on the broadcast samples, checkpoints its shards and joins the exports."""
        from jaxrl_vlm.checkpoint import CheckpointStore, abstract_like
        from jaxrl_vlm.data.geo3k import PromptIterator
        from jaxrl_vlm.distributed import barrier, broadcast_samples, export_hf, is_main_process
        from jaxrl_vlm.run_log import RunLog, plot_run
        from jaxrl_vlm.weight_sync import WeightSyncer
        from rollout.driver import driver_checkpoint_state, restore_driver_state
        from rollout.loading import load_function
        from rollout.metrics import rollout_metrics

        cfg = self.cfg
        main = is_main_process()
        if main:
            prepare_assets(cfg)  # created once, by process 0 (a shared filesystem is assumed across hosts)
        barrier("jaxrl_vlm.assets")
        model_dir, data_path = prepare_assets(cfg)
        prompts = PromptIterator(load_dataset(cfg, data_path), cfg.rollout.rollout_batch_size,
                                 shuffle=cfg.data.rollout_shuffle, seed=cfg.train.seed)
        self.build_policy(model_dir)
        args = cfg.to_namespace()
        start_step, version = 0, 0
        driver_state = None
        if cfg.checkpoint.load:
            store = CheckpointStore(cfg.checkpoint.load, keep=cfg.checkpoint.keep_checkpoints, read_only=True)
            start_step, self.state, meta = store.restore(abstract_like(self.state))
            store.close()
            prompts.load_state_dict(meta["prompt_iterator"])
            version = int(meta["weight_version"])
            args._next_group_index = int(meta["next_group_index"])
            driver_state = meta.get("driver_state")
            if driver_state is None:
                logger.warning("%s has no rollout driver state (an older checkpoint): buffered prompts and carried "
                               "partial groups of the interrupted run are not restored", cfg.checkpoint.load)
            logger.info("resumed from %s at step %d (weight version %d)", cfg.checkpoint.load, start_step, version)

        ckpt = CheckpointStore(cfg.checkpoint.save or self.out_dir / "checkpoints", keep=cfg.checkpoint.keep_checkpoints)
        sync_dtype = cfg.engine.weight_sync_dtype or ("bfloat16" if cfg.engine.engine_url else cfg.model.param_dtype)
        syncer = WeightSyncer(None, cfg.engine.weight_sync_dir or self.out_dir / "weights", copy_from=str(model_dir),
                              dtype=jnp.dtype(sync_dtype))
        # A resumed run's engine must start from the resumed weights, not the original checkpoint.
        serve_dir = (await syncer.push(self.policy_model(), version)).path if start_step > 0 else model_dir
        rollout_fn = load_function(cfg.rollout.rollout_function_path, "--rollout-function-path")
        log = RunLog(self.out_dir, total_steps=cfg.rollout.num_rollout) if main else None
        session = rollout_session(cfg, model_dir, serve_dir, args, str(version)) if main else contextlib.nullcontext()
        last: dict[str, Any] = {}
        try:
            async with session as client:
                syncer.client = client
                if main and driver_state is not None:
                    restore_driver_state(args, driver_state)
                for step in range(start_step, cfg.rollout.num_rollout):
                    t0 = time.perf_counter()
                    result = await rollout_fn(args, step, prompts) if main else None
                    samples = broadcast_samples(result.samples if main else None)
                    metrics: dict[str, Any] = dict(rollout_metrics(result.samples, result)) if main else {}
                    metrics["time/rollout_s"] = time.perf_counter() - t0
                    if samples:
                        t1 = time.perf_counter()
                        metrics.update(self.train_on(samples))
                        metrics["time/train_s"] = time.perf_counter() - t1
                        version += 1
                        t2 = time.perf_counter()
                        if not cfg.engine.disable_weight_sync:
                            report = await syncer.push(self.policy_model(), version)
                            metrics["sync/export_s"] = report.export_s
                            metrics["sync/gbytes"] = report.bytes_written / 1e9
                        metrics["time/sync_s"] = time.perf_counter() - t2
                    elif main:
                        logger.warning("step %d: no trainable samples (dropped %s); no update", step, dict(result.dropped))
                    metrics["time/step_s"] = time.perf_counter() - t0
                    metrics["weight_version"] = version
                    if log is not None:
                        log.log(step, metrics)
                    last = metrics
                    done = step + 1
                    if done == cfg.rollout.num_rollout or (cfg.checkpoint.save_interval and done % cfg.checkpoint.save_interval == 0):
                        ckpt.save(done, self.state, {
                            "prompt_iterator": prompts.state_dict(), "weight_version": version,
                            "next_group_index": int(getattr(args, "_next_group_index", 0)), "config": cfg.to_dict(),
                            "driver_state": driver_checkpoint_state(args) if main else None,
                        })
            export_hf(self.policy_model(), self.out_dir / "final_model", copy_from=str(model_dir))
            if log is not None:
                plot_run(log.path, self.out_dir / "plots")
            return last
        finally:
            if log is not None:
                log.close()
            ckpt.close()


def train(cfg: Config) -> dict[str, Any]:
    """Run the main job to the end; returns the last step's metrics."""
    return asyncio.run(Trainer(cfg).run())
