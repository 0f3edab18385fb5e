"""The learner: the sharded policy and optimizer state, and one update from a list of finished samples.

RL: samples -> advantages (grouped by `group_index`) -> fixed-shape batches on the mesh -> compiled train steps.
SFT (`--loss-type sft_loss`): conversations -> the same batches (token-mean weights, no advantages) -> the same
compiled steps with the NLL of the assistant tokens at temperature 1; `nll` scores held-out conversations.
It knows nothing about engines or rollouts; the run loops (`job/run.py`, `job/sft.py`) feed it and export its
weights. With LoRA (`--lora-rank`, `jaxrl_vlm/lora/`) the trained state is the adapters, the base is frozen beside
them (`frozen`, also the reference policy), and `policy_model()` is the merged model, carrying its adapters. With
`--freeze-vision-tower` / `--freeze-vision-merger` (`models/freezing.py`) the same mechanism holds those parameters
beside the trained ones (`frozen`, in the parameter dtype), and every forward joins them back.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_vlm.batching import TrainBatch, build_train_batch
from jaxrl_vlm.config import Config, is_sft
from jaxrl_vlm.device_lock import exclusive
from jaxrl_vlm.devices import pick_devices
from jaxrl_vlm.errors import ConfigError
from jaxrl_vlm.lora.adapters import (
    PolicyAdapters,
    adapter_shardings,
    attach_adapters,
    init_adapters,
    lora_setup,
    merged_params,
)
from jaxrl_vlm.lora.optim import adapter_optimizer
from jaxrl_vlm.distributed import global_batch
from jaxrl_vlm.models.freezing import NOTHING_FROZEN, FrozenParts, frozen_parts, join_params, split_params
from jaxrl_vlm.models.hf_io import from_hf, load_hf_config
from jaxrl_vlm.rl.advantages import compute_advantages
from jaxrl_vlm.rl.losses import LossConfig
from jaxrl_vlm.rl.options import LossOptions
from jaxrl_vlm.privileged import alignment, teacher_views
from jaxrl_vlm.rl.opsd import PrivilegedTeacher
from jaxrl_vlm.rl.train_step import (
    StepConfig,
    TrainState,
    compile_train_step,
    compute_logprobs,
    make_optimizer,
    privileged_hidden,
)
from jaxrl_vlm.sharding.activations import ActivationSharding
from jaxrl_vlm.sharding.layout import (
    batch_sharding,
    batch_shardings,
    build_mesh,
    param_shardings,
    row_multiple,
    sequence_shards,
    shardings_for,
)
from jaxrl_vlm.sharding.rules import resolve_rules
from rollout.hooks import Hook, load_hook
from rollout.processing import frame_patches, load_image_processor, max_frame_patches
from rollout.video import max_clip_frame_patches, optional_video_config
from rollout.sample import Sample
from rollout.sglang_wire import logprob_temperature


# ----------------------------------------------------------------------------- config -> RL math
def aggregation_mode(cfg: Config) -> str:
    """How token losses are reduced: `--loss-aggregation`, except SFT, whose loss is always the mean NLL over the
    batch's assistant tokens (slime's SFT runs pass `--calculate-per-token-loss`)."""
    return "token_mean" if is_sft(cfg) else cfg.algo.loss_aggregation


def aggregation_constant(cfg: Config) -> float | None:
    """Dr.GRPO's divisor: the configured constant, else the response budget (as the option's help says)."""
    if aggregation_mode(cfg) != "seq_mean_token_sum_norm":
        return cfg.algo.loss_aggregation_constant
    return cfg.algo.loss_aggregation_constant or float(cfg.rollout.rollout_max_response_len)


def loss_config(cfg: Config, num_sequences: int) -> LossConfig:
    """The loss hyper-parameters of the run (every `LossOptions` field, copied by name from the algo section that
    composes them), with what the trainer derives: the batch's sequence bound and the effective aggregation."""
    options = {f.name: cfg.option(f.name) for f in dataclasses.fields(LossOptions)}
    return LossConfig(**options, num_sequences=num_sequences, aggregation=aggregation_mode(cfg),
                      aggregation_constant=aggregation_constant(cfg))


def training_temperature(cfg: Config) -> float:
    """The temperature of the policy the engine samples (and reports log-probs of) in training rollouts; 1 for SFT,
    whose NLL is of the model's own distribution.

    Evaluation sampling settings never enter here: the trainer scores only what training rollouts sampled.
    """
    if is_sft(cfg):
        return 1.0
    return logprob_temperature(cfg.rollout.rollout_temperature)


def step_config(cfg: Config, num_sequences: int, *, old_from_current: bool, activations: ActivationSharding | None) -> StepConfig:
    """The static settings of the compiled train step for batches of up to `num_sequences` per micro-batch."""
    return StepConfig(
        loss=loss_config(cfg, num_sequences),
        loss_type=cfg.algo.loss_type,
        policy_loss=cfg.algo.policy_loss,
        custom_loss_path=cfg.algo.custom_loss_function_path if cfg.algo.loss_type == "custom_loss" else None,
        logprob_chunk_size=cfg.model.logprob_chunk_size,
        need_entropy=not is_sft(cfg),  # RL logs train/entropy_loss always, as slime does; the NLL needs none
        temperature=training_temperature(cfg),
        old_from_current=old_from_current,
        activations=activations,
    )


def sequences_bucket(n: int) -> int:
    """Static bound on sequences per micro-batch, rounded up to a power of two so it rarely recompiles."""
    return 1 << max(0, int(n) - 1).bit_length()


def sample_advantages(samples: list[Sample], cfg: Config, rewards: np.ndarray | None = None) -> np.ndarray:
    """One advantage per sample from its reward (or the given shaped `rewards`), grouped by `group_index`, by
    `--advantage-estimator` or the `--custom-advantage-function-path` hook that replaces it."""
    if rewards is None:
        rewards = np.array([float(s.reward) for s in samples], np.float64)
    groups = np.array([s.group_index for s in samples], np.int64)
    a = cfg.algo
    estimator = load_hook(a.custom_advantage_function_path, "custom_advantage_function_path") or a.advantage_estimator
    return compute_advantages(rewards, groups, estimator, std_normalization=not a.disable_grpo_std_normalization)


def post_process_rewards(hook: Hook, args: Any, samples: list[Sample]) -> tuple[list[float], list[float]]:
    """slime's `--custom-reward-post-process-path`: `fn(args, samples) -> (raw_rewards, rewards)`, each one finite
    float per sample (HookError naming the flag and path otherwise)."""
    out = hook(args, samples)
    hook.expect(isinstance(out, tuple) and len(out) == 2, "a (raw_rewards, rewards) tuple", out)
    n = len(samples)
    return hook.expect_finite_numbers(out[0], n, "raw_rewards"), hook.expect_finite_numbers(out[1], n, "rewards")


def per_sample_token_values(batch: TrainBatch, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(values [N, L], loss mask [N, L]) of each sample's target slots, from [K, R, T] batch-shaped `values`."""
    placements = batch.layout.placements
    width = max(p.length for p in placements)
    out = np.zeros((len(placements), width), np.float64)
    mask = np.zeros((len(placements), width), np.float64)
    for p in placements:
        cols = slice(p.offset, p.offset + p.length)
        out[p.sample_position, : p.length] = values[p.micro_batch, p.row, cols]
        mask[p.sample_position, : p.length] = batch.arrays.loss_mask[p.micro_batch, p.row, cols]
    return out, mask


@jax.jit
def _masked_nll(logprobs: jax.Array, loss_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(-sum of the masked log-probs, number of masked tokens) of a [K, R, T] batch, as replicated scalars (every
    process can read them)."""
    return -jnp.sum(jnp.where(loss_mask > 0, logprobs, 0.0)), jnp.sum(loss_mask)


# ----------------------------------------------------------------------------- the learner
def check_context_parallel(cfg: Config, cp: int) -> None:
    """Context parallelism splits every padded row into `cp` equal blocks through the activation constraints: the
    row lengths must divide, and the constraints must be on."""
    if cp == 1:
        return
    if not cfg.mesh.activation_constraints:
        raise ConfigError(f"context parallelism ({cp} sequence shards) works through the activation constraints; "
                          "set mesh.activation_constraints: true")
    bad = [b for b in cfg.batching.seq_buckets if b % cp]
    if bad:
        raise ConfigError(f"batching.seq_buckets {bad} are not multiples of the {cp} sequence shards of the mesh "
                          "(mesh_context); every padded row is split into equal contiguous blocks")


def frame_patch_cap(model_dir: Path | str) -> int | None:
    """The most patches of one frame (a picture's, or a clip's) the model directory's image and video processors
    can produce (None: no image processor, or no cap). The vision tower's XLA attention is then computed chunk by
    chunk instead of over every pair of patches of a micro-batch (`models.qwen3_vl.local_segment_attention`): the
    same numbers, and on a packed batch of small images a fraction of the work."""
    if not (Path(model_dir) / "preprocessor_config.json").is_file():
        return None
    try:
        cap = max_frame_patches(load_image_processor(model_dir))
    except ValueError:
        return None
    video = optional_video_config(model_dir)
    return cap if video is None else max(cap, max_clip_frame_patches(video))


def check_frame_patches(samples: list[Sample], cap: int | None) -> None:
    """Every image frame of the samples fits the vision attention's bound: images preprocessed by another
    processor than the model directory's (e.g. a custom generate function's) would otherwise attend wrongly."""
    if cap is None:
        return
    for s in samples:
        for key, kind in (("image_grid_thw", "image"), ("video_grid_thw", "clip")):
            grid = s.multimodal_train_inputs.get(key) if s.multimodal_train_inputs else None
            if grid is None or len(grid) == 0:
                continue
            frame = frame_patches(grid)
            if int(frame.max()) > cap:
                raise ValueError(
                    f"sample (group {s.group_index}, index {s.index}) has a{'n' if kind == 'image' else ''} {kind} "
                    f"frame of {int(frame.max())} patches, more than the {cap} that the model's processors allow "
                    "(their pixel caps): it was not preprocessed with the model directory's processor configs")


def check_lora_outside_frozen(setup: Any, frozen: FrozenParts) -> None:
    """No adapter and no module to save may sit on a frozen parameter: a frozen part has no trained state."""
    if not frozen:
        return
    inside = [s.module for s in setup.sites if any(tuple(p) in frozen.paths for p in s.link.ours)]
    inside += [m.module for m in setup.saved if any(tuple(link.ours[0]) in frozen.paths for _, link, _, _ in m.tensors)]
    if inside:
        raise ConfigError(
            f"--freeze-vision-tower / --freeze-vision-merger freeze {len(inside)} module(s) that LoRA would train "
            f"({', '.join(inside[:3])}{', ...' if len(inside) > 3 else ''}: --lora-vision or --lora-modules-to-save): "
            "drop --lora-vision (or those modules), or the freeze flag")


def check_routing_replay(cfg: Config, model_cfg: Any) -> None:
    """Routing replay (either flag) on a dense model can only be a mistake: it has no router to replay."""
    if not getattr(model_cfg.text, "sparse_layers", ()):
        for flag, on in (("--use-routing-replay", cfg.train.use_routing_replay),
                         ("--use-rollout-routing-replay", cfg.rollout.use_rollout_routing_replay)):
            if on:
                raise ConfigError(f"{flag} replays a mixture-of-experts router's choices, but {cfg.model.hf_checkpoint} "
                                  f"is a dense {type(model_cfg).__name__} (no sparse layer): drop the flag")


def replays_old_routing(cfg: Config, single: bool) -> bool:
    """Whether the old-policy forward records its experts for the updates to replay (--use-routing-replay): not
    with one update per rollout (`single`: the old policy is the current one, so the flag changes nothing), and
    not under --use-rollout-routing-replay, whose engine ids the batch already carries for every forward (slime:
    R3 implies routing replay, with the rollout's routing)."""
    return cfg.train.use_routing_replay and not single and not cfg.rollout.use_rollout_routing_replay


def _tokenizer_vocab(model_dir: Path | str, role: str) -> dict[str, int]:
    """token -> id of `<model_dir>/tokenizer.json`, added tokens included; ConfigError naming the file when absent."""
    from tokenizers import Tokenizer  # transformers' own dependency

    file = Path(model_dir) / "tokenizer.json"
    if not file.is_file():
        raise ConfigError(f"--opd-type trainer compares the teacher's tokenizer with the student's, and the {role} "
                          f"has no {file}")
    return Tokenizer.from_file(str(file)).get_vocab(with_added_tokens=True)


def _vision_format(model_cfg: Any) -> tuple[Any, ...]:
    """What the batch's image inputs are built from (the family's vision input type, patch geometry, merge size,
    attention window): equal for two models means one batch's pictures feed both."""
    v = model_cfg.vision
    return (type(v).__name__, v.patch_dim, v.merge_unit, getattr(v, "window_size", None))


def teacher_mismatch(student_dir: Path | str, teacher_dir: Path | str, student_cfg: Any, teacher_cfg: Any) -> str | None:
    """Why an --opd-type trainer teacher cannot score the student's packed batch (None: it can), in one line naming
    the mismatch. Any family will do: the teacher reads the student's token ids, M-RoPE positions and image patches
    as they are, so the tokenizer (every token and id), the vocabulary size, the image token ids and the image-input
    format must be the same."""
    where = f"--opd-teacher-checkpoint {teacher_dir}"
    if teacher_cfg.text.vocab_size != student_cfg.text.vocab_size:
        return (f"{where} has vocab_size {teacher_cfg.text.vocab_size}, the student {student_dir} "
                f"{student_cfg.text.vocab_size}: a trainer teacher scores the student's token ids and must share its "
                "vocabulary")
    student_vocab, teacher_vocab = _tokenizer_vocab(student_dir, "student"), _tokenizer_vocab(teacher_dir, "teacher")
    if student_vocab != teacher_vocab:
        differ = sorted(set(student_vocab.items()) ^ set(teacher_vocab.items()), key=lambda kv: kv[1])
        return (f"{where} has another tokenizer than the student {student_dir} ({len(differ)} token/id pairs differ, "
                f"e.g. {differ[0][0]!r} -> {differ[0][1]}): a trainer teacher must share the student's tokenizer")
    for name in ("image_token_id", "vision_start_token_id"):
        if getattr(teacher_cfg, name) != getattr(student_cfg, name):
            return (f"{where} has {name} {getattr(teacher_cfg, name)}, the student {getattr(student_cfg, name)}: the "
                    "teacher would not find the student's pictures in the batch")
    if _vision_format(teacher_cfg) != _vision_format(student_cfg):
        return (f"{where} reads images as {_vision_format(teacher_cfg)} (vision type, patch dim, merge unit, window), "
                f"the student as {_vision_format(student_cfg)}: the batch's image patches are the student's")
    return None


class Trainer:
    """The policy being trained: parameters and optimizer state on the mesh, and `train_on(samples)`."""

    def __init__(self, cfg: Config, *, devices: list[Any] | None = None):
        """`devices`: the devices of the training mesh (default: --train-devices, else all of them)."""
        self.cfg = cfg
        if devices is None and cfg.mesh.train_device_ids is not None:
            if jax.process_count() > 1:
                raise ConfigError("--train-devices places the trainer on one host's devices; a multi-process job's "
                                  "mesh spans every process (leave it unset)")
            devices = pick_devices(cfg.mesh.train_device_ids, "--train-devices")
        self.devices = devices
        self.out_dir = Path(cfg.train.output_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._step_fns: dict[tuple[int, bool, float], Any] = {}
        self._logprob_fn: Any = None
        self._privileged_fn: Any = None
        self._merge_fn: Any = None
        # LoRA (--lora-rank > 0): the adapters' setup, and the frozen base state they adapt (`state.params` are then
        # the adapters, all that trains and has optimizer state).
        self.lora = None
        self.frozen: Any = None
        self.frozen_shardings: Any = None
        # --freeze-vision-tower / --freeze-vision-merger: the parameters held in `frozen` without LoRA (with LoRA the
        # whole base is frozen already), which a weight sync may leave out.
        self.frozen_parts: FrozenParts = NOTHING_FROZEN
        # The train step donates the parameters' buffers (updated in place), unless an in-process engine serves
        # them as they are (`share_params`).
        self.donate_params = True
        # --opd-type trainer: the frozen teacher (graph and parameter state on the training mesh), else None.
        self.teacher_graphdef: Any = None
        self.teacher_params: Any = None
        self.teacher_shardings: Any = None

    # -------------------------------------------------------------------------- setup
    def build_policy(self, model_dir: Path) -> None:
        """Load the HF checkpoint straight into its shards and create the optimizer state beside it."""
        cfg = self.cfg
        self.mesh = build_mesh(cfg.mesh, self.devices)
        self.rules = resolve_rules(cfg.mesh.sharding_rules)
        check_context_parallel(cfg, sequence_shards(self.mesh, self.rules))
        placement = shardings_for(self.mesh, self.rules, load_hf_config(str(model_dir)))
        self.frame_patch_cap = frame_patch_cap(model_dir)
        model = from_hf(
            str(model_dir), param_dtype=jnp.dtype(cfg.model.param_dtype), shardings_for=placement,
            compute_dtype=jnp.dtype(cfg.model.compute_dtype), remat=cfg.model.remat,
            attention_impl=cfg.model.attention_impl, patch_attention_block=self.frame_patch_cap,
        )
        self.model_cfg = model.cfg
        check_routing_replay(cfg, model.cfg)
        self.frozen_parts = frozen_parts(model, vision_tower=cfg.train.freeze_vision_tower,
                                         vision_merger=cfg.train.freeze_vision_merger)
        self.graphdef, params = nnx.split(model, nnx.Param)
        self.tx = make_optimizer(cfg.optim, cfg.rollout.num_rollout * cfg.train.num_steps_per_rollout)
        p_sh = param_shardings(params, self.mesh, self.rules)
        if cfg.lora.enabled:
            self.lora = lora_setup(model.cfg, params, cfg.lora)
            check_lora_outside_frozen(self.lora, self.frozen_parts)
            # The base never changes: held once, in the compute dtype the model casts every kernel to anyway.
            cd = jnp.dtype(cfg.model.compute_dtype)
            self.frozen = jax.device_put(jax.tree.map(lambda x: x.astype(cd), params), p_sh)
            self.frozen_shardings = p_sh
            adapters = init_adapters(self.lora, jax.random.fold_in(jax.random.key(cfg.train.seed), 1), params)
            del model, params
            p_sh = adapter_shardings(self.lora, self.mesh, self.rules)
            params = jax.device_put(adapters, p_sh)
            self.tx = adapter_optimizer(self.tx, cfg.lora.lora_plus_lr_ratio)  # LoRA+: lora_B at ratio x lr
        elif self.frozen_parts:
            # Kept as loaded (the parameter dtype, unlike LoRA's base): the forward is the unfrozen one's, bit for bit.
            params, self.frozen = split_params(params, self.frozen_parts.paths)
            p_sh, self.frozen_shardings = split_params(p_sh, self.frozen_parts.paths)
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
        if cfg.rollout.use_opd and cfg.rollout.opd_type == "trainer":
            self.build_teacher(model_dir)
        needs_ref = cfg.algo.use_kl_loss or cfg.algo.kl_coef != 0.0 or self.self_distills
        if self.lora is not None:
            # The reference is the base: the same parameters with the adapters switched off, no copy.
            self.ref_params = self.frozen if needs_ref else None
        else:
            self.ref_params = self._with_frozen(jax.tree.map(jnp.copy, params)) if needs_ref else None
        self._set_privileged_teacher()

    def build_teacher(self, student_dir: Path) -> None:
        """--opd-type trainer: load --opd-teacher-checkpoint beside the policy, on the same mesh with the same rules
        (its parameters sharded like the policy's, in the compute dtype: it never trains), after checking that it
        can read the student's batches (`teacher_mismatch`)."""
        cfg = self.cfg
        path = cfg.rollout.opd_teacher_checkpoint
        teacher_cfg = load_hf_config(path)
        problem = teacher_mismatch(student_dir, path, self.model_cfg, teacher_cfg)
        if problem:
            raise ConfigError(problem)
        cd = jnp.dtype(cfg.model.compute_dtype)
        teacher = from_hf(str(path), param_dtype=cd, shardings_for=shardings_for(self.mesh, self.rules, teacher_cfg),
                          compute_dtype=cd, remat=cfg.model.remat, attention_impl=cfg.model.attention_impl,
                          patch_attention_block=self.frame_patch_cap)
        self.teacher_graphdef, self.teacher_params = nnx.split(teacher, nnx.Param)
        self.teacher_shardings = param_shardings(self.teacher_params, self.mesh, self.rules)

    def _activations(self) -> ActivationSharding | None:
        return ActivationSharding.from_config(self.cfg.mesh, self.mesh, self.rules)

    def _step_fn(self, num_sequences: int, old_from_current: bool) -> Any:
        key = (num_sequences, old_from_current, self.logprob_temperature)
        if key not in self._step_fns:
            cfg = step_config(self.cfg, num_sequences, old_from_current=old_from_current, activations=self._activations())
            self._step_fns[key] = compile_train_step(
                self.graphdef, self.tx, dataclasses.replace(cfg, lora=self.lora), state_shardings=self.state_shardings,
                batch_shardings=lambda tree: batch_shardings(tree, self.mesh, self.rules),
                frozen_shardings=self.frozen_shardings, donate_params=self.donate_params,
                teacher_graphdef=self.teacher_graphdef, teacher_shardings=self.teacher_shardings,
            )
        return self._step_fns[key]

    def share_params(self) -> None:
        """Keep the parameters' buffers through the train step (no donation), so that an engine in this process may
        serve the trainer's arrays as they are (`WeightSyncer.share_trainer_arrays`): a donated buffer would be
        deleted under it. Memory stays level: the step then writes new parameters beside the old ones, which the
        engine holds anyway instead of a copy of its own. Steps compiled before are compiled again."""
        if self.donate_params:
            self.donate_params = False
            self._step_fns.clear()

    @property
    def logprob_temperature(self) -> float:
        return training_temperature(self.cfg)

    def _logprobs(self, params: Any, device_batch: Any, *, with_routing: bool = False) -> Any:
        """Old or reference log-probs of a batch, at the rollout temperature (one program per batch shape); with
        `with_routing`, (log-probs, the expert ids that forward used [K, R, T, L_sparse, k])."""
        if self._logprob_fn is None:
            # Laid out like the batch (rows split, positions whole), which the train step expects them in; under
            # context parallelism they leave the model split over the positions. The expert ids too: one
            # row-split sharding covers both outputs.
            self._logprob_fn = jax.jit(
                compute_logprobs, static_argnums=(0,),
                static_argnames=("chunk_size", "temperature", "activations", "with_routing"),
                out_shardings=batch_sharding(self.mesh, self.rules),
            )
        return self._logprob_fn(
            self.graphdef, params, device_batch, chunk_size=self.cfg.model.logprob_chunk_size,
            temperature=self.logprob_temperature, activations=self._activations(), with_routing=with_routing,
        )

    def compiled_programs(self) -> int:
        return sum(len(getattr(f, "cache", {})) for f in self._step_fns.values())

    def _batch(self, samples: list[Sample], advantages: np.ndarray, *, seq_buckets: list[int] | None = None,
               routing_replay: bool | None = None) -> tuple[TrainBatch, Any]:
        cfg = self.cfg
        check_frame_patches(samples, self.frame_patch_cap)
        shards = row_multiple(self.mesh, self.rules)  # devices the batch rows are split over
        # Under context parallelism a row's tokens are spread over its context group: the per-device budget
        # plans rows per group.
        per_row_devices = sequence_shards(self.mesh, self.rules)
        budget = cfg.batching.max_tokens_per_device
        batch = build_train_batch(
            samples, advantages.astype(np.float32), self.model_cfg,
            seq_buckets=cfg.batching.seq_buckets if seq_buckets is None else seq_buckets,
            row_buckets=cfg.batching.row_buckets,
            patch_buckets=cfg.batching.patch_buckets, packing=cfg.batching.packing,
            micro_batch_rows=cfg.train.micro_batch_size, row_multiple=shards,
            aggregation=aggregation_mode(cfg), aggregation_constant=aggregation_constant(cfg),
            overlong_policy=cfg.batching.overlong_policy,
            max_tokens_per_micro_batch=None if budget is None else budget * shards * per_row_devices,
            routing_replay=cfg.rollout.use_rollout_routing_replay if routing_replay is None else routing_replay,
            vision_reuse=cfg.batching.vision_reuse,
            teacher_logprobs=cfg.rollout.use_opd and cfg.rollout.opd_type == "engine",  # trainer, self: the step scores
        )
        # Each process uploads only the rows its devices hold (plain device_put would first gather and compare
        # the whole batch across processes).
        return batch, global_batch(batch.arrays, self.mesh, rules=self.rules)

    # -------------------------------------------------------------------------- one update
    def train_on(self, samples: list[Sample]) -> dict[str, float]:
        """`_train_on` with the trainer's devices held (`device_lock`): an engine in this process that shares them
        runs none of its programs meanwhile (two threads' collectives on the same devices can deadlock)."""
        with exclusive(self.mesh.devices.flat):
            return self._train_on(samples)

    def _train_on(self, samples: list[Sample]) -> dict[str, float]:
        """Advantages -> fixed-shape batches -> compiled optimizer steps. One host sync (the metrics) per call.

        Advantages are computed over the whole rollout (grouped by `group_index`). The samples are then cut into
        optimizer batches of `--global-batch-size` (slime's meaning: samples per optimizer step), and each is
        trained `--num-steps-per-rollout` times. With one batch and one step the old log-probs are the current
        policy's own (the ratio is exactly 1, as in slime); otherwise they are computed for every batch with the
        pre-update weights before the first update; with --use-routing-replay that forward also records the
        experts it used, and every update of this rollout replays them (`replays_old_routing`). SFT (`--loss-type
        sft_loss`): the samples are conversations; there are no advantages and no old log-probs, and the loss is
        their assistant tokens' mean NLL.
        """
        cfg = self.cfg
        sft = is_sft(cfg)
        size = cfg.train.global_batch_size or len(samples)
        # SFT: no rewards, so no advantages (the batch's advantage arrays stay zero and its loss never reads them).
        advantages, kl_metrics = (np.zeros(len(samples)), {}) if sft else self.advantages(samples)
        chunks = [(samples[i : i + size], advantages[i : i + size]) for i in range(0, len(samples), size)]
        batches = [self._batch(chunk, adv) for chunk, adv in chunks]
        if self.self_distills and not sft:
            batches = [(b, self._with_privileged(chunk, adv, b, dev)) for (chunk, adv), (b, dev) in zip(chunks, batches)]
        # The NLL needs no old log-probs: SFT steps always take the current ones (never read).
        single = sft or (len(batches) == 1 and cfg.train.num_steps_per_rollout == 1)
        current = None if single else self.policy_params()
        # The reference routes itself (as slime's), so it reads the batches before the old routing joins them.
        scores_ref = self.ref_params is not None and (cfg.algo.use_kl_loss or cfg.algo.kl_coef != 0.0)
        ref = [self._logprobs(self.ref_params, dev) if scores_ref else None for _, dev in batches]
        if replays_old_routing(cfg, single):
            old_and_ids = [self._logprobs(current, dev, with_routing=True) for _, dev in batches]
            old = [lp for lp, _ in old_and_ids]
            batches = [(b, dev._replace(routed_experts=ids)) for (b, dev), (_, ids) in zip(batches, old_and_ids)]
        else:
            old = [None if single else self._logprobs(current, dev) for _, dev in batches]
        updates = []
        for _ in range(cfg.train.num_steps_per_rollout):
            for (batch, device_batch), old_lp, ref_lp in zip(batches, old, ref):
                # The NLL has no per-sequence term: one static bound keeps SFT at one program per batch shape.
                num_sequences = 1 if sft else sequences_bucket(batch.layout.max_sequences_per_micro_batch)
                step_fn = self._step_fn(num_sequences, single)
                self.state, step_metrics = step_fn(self.state, device_batch, old_lp, ref_lp, self.frozen,
                                                   self.teacher_params)
                updates.append(step_metrics)
        # Metrics of the optimizer steps of this rollout, averaged (one device->host transfer).
        per_step = jax.device_get(updates)
        metrics = {k: float(np.mean([m[k] for m in per_step])) for k in per_step[0]}
        metrics["train/optimizer_steps"] = float(len(per_step))
        metrics["batch/padding_efficiency"] = float(np.mean([b.layout.padding_efficiency for b, _ in batches]))
        metrics["batch/rows_per_micro_batch"] = float(batches[0][0].arrays.tokens.shape[1])
        metrics["batch/real_tokens"] = float(sum(b.layout.real_tokens for b, _ in batches))
        metrics["train/vision_images"] = float(sum(b.layout.images for b, _ in batches))
        metrics["train/vision_images_distinct"] = float(sum(b.layout.distinct_images for b, _ in batches))
        metrics["train/vision_clips"] = float(sum(b.layout.clips for b, _ in batches))
        metrics["train/vision_clips_distinct"] = float(sum(b.layout.distinct_clips for b, _ in batches))
        metrics["batch/compiled_programs"] = float(self.compiled_programs())
        if sft:
            return metrics
        metrics.update(kl_metrics)
        metrics["rollout/advantage_abs_mean"] = float(np.abs(advantages).mean())
        # slime's rollout/advantages: per-sample masked mean of the token advantages, averaged over samples.
        metrics["rollout/advantages"] = float(advantages.mean())
        return metrics

    def nll(self, samples: list[Sample], batch_size: int) -> tuple[float, float]:
        """(summed negative log-likelihood of the samples' masked target tokens at the training temperature, number
        of those tokens), with the current weights and no update, in batches of `batch_size` samples. A collective
        under several processes: every process calls it with the same samples."""
        with exclusive(self.mesh.devices.flat):  # as train_on
            return self._nll(samples, batch_size)

    def _nll(self, samples: list[Sample], batch_size: int) -> tuple[float, float]:
        total, tokens = 0.0, 0.0
        params = self.policy_params()
        for start in range(0, len(samples), batch_size):
            chunk = samples[start : start + batch_size]
            _, device_batch = self._batch(chunk, np.zeros(len(chunk), np.float32))
            logprobs = self._logprobs(params, device_batch)
            nll_sum, count = jax.device_get(_masked_nll(logprobs, device_batch.loss_mask))
            total += float(nll_sum)
            tokens += float(count)
        return total, tokens

    def start_from(self, params: Any) -> None:
        """Train from `params` (another run's weights, e.g. an SFT run's checkpoint): the optimizer state stays this
        run's fresh one, and the reference policy of the KL terms becomes these weights."""
        self.state = jax.device_put(self.state._replace(params=params), self.state_shardings)
        if self.ref_params is not None and self.lora is None:  # LoRA's reference stays the base
            self.ref_params = self._with_frozen(jax.tree.map(jnp.copy, self.state.params))
            self._set_privileged_teacher()

    @property
    def self_distills(self) -> bool:
        """--use-opd --opd-type self: the frozen initial policy (`ref_params`) reads each episode with privileged
        information, and the clipped JSD joins the loss (rl/opsd.py)."""
        return self.cfg.rollout.use_opd and self.cfg.rollout.opd_type == "self"

    def _set_privileged_teacher(self) -> None:
        """--opd-type self: the step's teacher is the reference policy's LM head (its hidden states come with the
        batch, `_with_privileged`)."""
        if not self.self_distills:
            return
        kernel = jax.jit(lambda p: nnx.merge(self.graphdef, p).lm_head_kernel())(self.ref_params)
        self.teacher_params = PrivilegedTeacher(kernel)
        self.teacher_shardings = PrivilegedTeacher(kernel.sharding)
        self._step_fns.clear()

    def _with_privileged(self, samples: list[Sample], advantages: np.ndarray, batch: TrainBatch,
                         device_batch: Any) -> Any:
        """--opd-type self: the device batch with the teacher's hidden states on its target slots. The teacher's
        views of `samples` (privileged prompt, then the student's tokens) are packed like the student's, with a
        seq bucket that fits them, and read by the frozen initial policy; `privileged.alignment` says which of
        its slots predicts each student target."""
        views = teacher_views(samples)
        longest = max(len(v.tokens) for v in views)
        buckets = list(self.cfg.batching.seq_buckets)
        if longest > max(buckets):
            buckets.append(-(-longest // 64) * 64)
        teacher, teacher_dev = self._batch(views, advantages, seq_buckets=buckets, routing_replay=False)
        where = alignment(batch, teacher, samples)
        where_dev = global_batch(where, self.mesh, rules=self.rules)
        if self._privileged_fn is None:
            self._privileged_fn = jax.jit(privileged_hidden, static_argnums=(0,), static_argnames=("activations",),
                                          out_shardings=batch_sharding(self.mesh, self.rules, ndim=4))
        hidden = self._privileged_fn(self.graphdef, self.ref_params, teacher_dev, where_dev.index,
                                     activations=self._activations())
        return device_batch._replace(privileged_hidden=hidden, privileged_valid=where_dev.valid)

    def advantages(self, samples: list[Sample]) -> tuple[np.ndarray, dict[str, float]]:
        """Advantages of a rollout, after `--custom-reward-post-process-path` (its rewards replace the samples'; it
        runs on every training process) and `--kl-coef` reward shaping when they are on (with their metrics).

        Shaping (slime's `--kl-coef`): each sample's reward loses kl_coef * sum over its model tokens of the k1
        estimate log p_old - log p_ref (the current weights before this update vs the initial policy), before
        the advantages. slime applies it only inside its reinforce++/ppo returns and silently ignores it for
        grpo/gspo; here it shapes the reward for every estimator (docs/guides/slime.md says so).
        """
        cfg = self.cfg
        rewards = np.array([float(s.reward) for s in samples], np.float64)
        metrics: dict[str, float] = {}
        hook = load_hook(cfg.algo.custom_reward_post_process_path, "custom_reward_post_process_path")
        if hook is not None:  # slime's reward post-processing, before the estimator (and before --kl-coef)
            raw, processed = post_process_rewards(hook, cfg.to_namespace(), samples)
            rewards = np.array(processed, np.float64)
            metrics["rollout/raw_reward"] = float(np.mean(raw))
            metrics["rollout/rewards"] = float(rewards.mean())
        if cfg.algo.kl_coef == 0.0:
            return sample_advantages(samples, cfg, rewards), metrics
        kl_sums = np.zeros(len(samples), np.float64)
        size = cfg.train.global_batch_size or len(samples)
        current = self.policy_params()
        for start in range(0, len(samples), size):
            chunk = samples[start : start + size]
            batch, device_batch = self._batch(chunk, np.zeros(len(chunk), np.float32))
            k1 = self._logprobs(current, device_batch) - self._logprobs(self.ref_params, device_batch)
            per_token, mask = per_sample_token_values(batch, np.asarray(jax.device_get(k1)))
            kl_sums[start : start + len(chunk)] = (per_token * mask).sum(axis=1)
        shaped = rewards - cfg.algo.kl_coef * kl_sums
        metrics.update({"rollout/kl_penalty_mean": float(cfg.algo.kl_coef * kl_sums.mean()),
                        "rollout/shaped_reward_mean": float(shaped.mean())})
        return sample_advantages(samples, cfg, shaped), metrics

    def _with_frozen(self, trained: Any) -> Any:
        """The whole parameter state from trained parameters (`trained` itself when nothing is frozen beside them)."""
        return trained if self.lora is not None or self.frozen is None else join_params(trained, self.frozen)

    def policy_params(self) -> Any:
        """The parameter state of the current policy: the trained parameters (joined with the frozen vision parts,
        no copy), or with LoRA the base with the adapters merged in (a new state; the base is untouched)."""
        if self.lora is None:
            return self._with_frozen(self.state.params)
        if self._merge_fn is None:
            self._merge_fn = jax.jit(lambda base, adapters: merged_params(base, adapters, self.lora),
                                     out_shardings=self.frozen_shardings)
        return self._merge_fn(self.frozen, self.state.params)

    def base_model(self) -> Any:
        """LoRA's frozen base as a model (in the compute dtype): what an engine that serves the adapters starts from."""
        if self.lora is None:
            raise RuntimeError("base_model: this run trains every parameter (no LoRA base)")
        return nnx.merge(self.graphdef, self.frozen)

    def policy_model(self) -> Any:
        """The current policy as a model (for export and weight sync); with LoRA the merged model, which carries its
        adapters (`lora.adapters.adapters_of`) so an engine that serves adapters is sent only those."""
        model = nnx.merge(self.graphdef, self.policy_params())
        if self.lora is None:
            return model
        return attach_adapters(model, PolicyAdapters(self.lora, jax.tree.map(jnp.copy, self.state.params)))
