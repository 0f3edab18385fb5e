"""The compiled GRPO-family train step: micro-batch scan, loss registry, clipping, AdamW, NaN guard. The same step
trains SFT's NLL and the user's custom loss (`--loss-type`, the `LOSS_TYPES` registry).

One `jax.jit` per batch shape, with explicit in/out shardings on the configured mesh:

* the batch carries a leading micro-batch axis K; gradients and metrics are accumulated over it with
  `lax.scan` inside the program (no host round trip between micro-batches);
* the loss weights were computed on the host over the global batch (`aggregation_weights`), so the summed
  micro-batch gradients equal the unsplit batch's gradient exactly; each metric combines over micro-batches by
  the reduction it carries (`rl/metrics.py`);
* old log-probs: with one optimizer step per rollout they are the current policy's own (detached) log-probs,
  as slime does, so the ratio is exactly 1; with several steps they are computed once before the first step
  (`compute_logprobs`) and passed in;
* a mixture-of-experts family adds its router terms (`rl/router_losses.py`: --router-aux-loss-coef,
  --router-z-loss-coef, over real tokens) to the loss and logs per-layer expert load as `moe/...`; a batch with
  `routed_experts` routes every forward that reads it with those expert ids: the engine's
  (--use-rollout-routing-replay: old, reference and current forwards), or the old policy's own, which
  `compute_logprobs(..., with_routing=True)` returns for the trainer to replay in the current forwards of every
  optimizer step of a rollout (--use-routing-replay); a dense family computes and logs none of it;
* on-policy distillation folds the teacher's log-probs into the advantages (`opd_terms`): stored on the batch
  (--opd-type engine) or scored in this program by a frozen second model (--opd-type trainer, `teacher_logprobs`);
* a non-finite loss or gradient (norm) skips the update (params and optimizer state unchanged) and is reported in
  the metrics (`train/skipped_nonfinite`), never written into the weights.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxrl_vlm.compile_cache import compile_outside_persistent_cache, fenced_from_persistent_cache
from jaxrl_vlm.lora.adapters import LoraSetup, merged_params, with_rank_dropout
from jaxrl_vlm.models.activation_sharding import ActivationLayout, activation_sharding
from jaxrl_vlm.models.families import PolicyModel
from jaxrl_vlm.models.freezing import join_params
from jaxrl_vlm.models.layers import token_logprobs
from jaxrl_vlm.rl.losses import LossConfig, LossFn, LossInputs, select_loss
from jaxrl_vlm.rl.metrics import Metric, accumulate_metrics, finalize_metrics, init_metrics
from jaxrl_vlm.rl.opd import opd_advantages, opd_metrics
from jaxrl_vlm.rl.opsd import PrivilegedTeacher, opsd_term
from jaxrl_vlm.rl.router_losses import load_metrics, router_terms

class TrainState(NamedTuple):
    """Everything that changes during training (a pytree; checkpointed as a whole)."""

    params: Any  # nnx.State of the policy's nnx.Param variables
    opt_state: Any
    step: jax.Array  # int32 scalar: optimizer updates applied
    rng: jax.Array  # uint32 key data


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static (hashable) settings of the compiled step."""

    loss: LossConfig
    # What the step trains (`select_loss`): --loss-type (a LOSS_TYPES name: policy_loss, custom_loss, sft_loss),
    # --policy-loss (a POLICY_LOSSES name, for policy_loss) and --custom-loss-function-path (for custom_loss).
    loss_type: str = "policy_loss"
    policy_loss: str = "ppo_clip"
    custom_loss_path: str | None = None
    logprob_chunk_size: int = 512
    need_entropy: bool = False
    # Log-probs and entropy are those of softmax(logits / temperature): the rollout's sampling distribution.
    temperature: float = 1.0
    old_from_current: bool = True  # one optimizer step per rollout: old log-probs = detached current ones
    # Mesh + rules for the model's activation constraints (None: let XLA propagate from the inputs alone).
    activations: ActivationLayout | None = None
    # LoRA: `TrainState.params` are the adapters and the step's `frozen` argument is the base state they adapt.
    # Without LoRA a `frozen` argument holds the parameters the run freezes (`models/freezing.py`), joined to
    # `TrainState.params` in every forward.
    lora: LoraSetup | None = None


def make_optimizer(optim: Any, total_steps: int) -> optax.GradientTransformation:
    """AdamW with the configured schedule, global-norm clipping first (slime's order). A decaying schedule ends at
    `lr_decay_iters` when set (Megatron's meaning: counted from step 0, warm-up included), else at `total_steps`, and
    holds `min_lr` after it."""
    warmup = int(optim.lr_warmup_iters)
    horizon = total_steps if optim.lr_decay_iters is None else int(optim.lr_decay_iters)
    decay_steps = max(1, horizon - warmup)
    if optim.lr_decay_style == "constant":
        decay = optax.constant_schedule(optim.lr)
    elif optim.lr_decay_style == "linear":
        decay = optax.linear_schedule(optim.lr, optim.min_lr, decay_steps)
    elif optim.lr_decay_style == "cosine":
        decay = optax.cosine_decay_schedule(optim.lr, decay_steps, alpha=optim.min_lr / optim.lr if optim.lr else 0.0)
    else:
        raise ValueError(f"unknown lr_decay_style {optim.lr_decay_style!r}")
    schedule = optax.join_schedules([optax.linear_schedule(0.0, optim.lr, warmup), decay], [warmup]) if warmup else decay
    parts = []
    if optim.clip_grad and optim.clip_grad > 0:
        parts.append(optax.clip_by_global_norm(optim.clip_grad))
    parts.append(
        optax.adamw(schedule, b1=optim.adam_beta1, b2=optim.adam_beta2, eps=optim.adam_eps, weight_decay=optim.weight_decay)
    )
    return optax.chain(*parts)


def _micro(tree: Any, k: jax.Array | int) -> Any:
    return jax.tree.map(lambda x: x[k], tree)


def routes_experts(model: PolicyModel) -> bool:
    """True for a mixture-of-experts family: its text config lists `sparse_layers` and its model has
    `forward(tokens, positions, segment_ids, vision, routed_experts) -> (hidden, Routing | None)`."""
    return bool(getattr(model.cfg.text, "sparse_layers", ()))


def replay_ids(mb: Any) -> jax.Array | None:
    """The micro-batch's engine top-k ids [L_sparse, R, T, k] for routing replay (-1: the trainer routes that
    token itself), or None when the batch carries none."""
    routed = getattr(mb, "routed_experts", None)
    return None if routed is None else jnp.moveaxis(routed, 2, 0)


def used_expert_ids(routing: Any, segment_ids: jax.Array) -> jax.Array:
    """The top-k ids a forward's sparse layers used, int32 [R, T, L_sparse, k] from `routing` ([L_sparse, R, T, k]
    ids), -1 on padding (segment id 0): the layout of `TrainArrays.routed_experts`, so replaying the trainer's
    own routing (--use-routing-replay) takes the same path as replaying the engine's (R3)."""
    ids = jnp.moveaxis(routing.topk_ids, 0, 2).astype(jnp.int32)
    return jnp.where((segment_ids > 0)[..., None, None], ids, -1)


def policy_forward(model: PolicyModel, mb: Any) -> tuple[jax.Array, Any]:
    """(hidden [R, T, D], `moe.Routing` [L_sparse, R, T, ...] or None for a dense family) of one micro-batch; an
    MoE family replays `mb.routed_experts` when the batch carries them."""
    if not routes_experts(model):
        return model(mb.tokens, mb.positions, mb.segment_ids, mb.vision), None
    return model.forward(mb.tokens, mb.positions, mb.segment_ids, mb.vision, replay_ids(mb))


def policy_logprobs(
    graphdef: nnx.GraphDef, params: Any, mb: Any, *, chunk_size: int, need_entropy: bool, temperature: float = 1.0,
    with_routing: bool = False, with_model: bool = False,
):
    """Per-token log-probs (and entropy) of `mb.targets` under `params` at `temperature`, one micro-batch [R, T];
    with `with_routing` also the routing (None for a dense family) as a third value; with `with_model` also the
    merged model and its hidden states [R, T, D] (on-policy self-distillation reads the full-vocabulary logits)."""
    model: PolicyModel = nnx.merge(graphdef, params)
    hidden, routing = policy_forward(model, mb)
    lp, ent = token_logprobs(
        model, hidden, mb.targets, chunk_size=chunk_size, return_entropy=need_entropy, temperature=temperature
    )
    out = (lp, ent, routing) if with_routing else (lp, ent)
    return (*out, model, hidden) if with_model else out


def privileged_hidden(graphdef: nnx.GraphDef, params: Any, batch: Any, index: jax.Array,
                      activations: ActivationLayout | None = None) -> jax.Array:
    """--opd-type self: the frozen teacher's hidden states over its privileged batch [K', R', T', D], gathered
    onto the student batch's target slots through `index` [K, R, T] (jaxrl_vlm/privileged.py `alignment`): [K, R,
    T, D], no gradient. An MoE teacher routes every token itself."""

    def one(k):
        model: PolicyModel = nnx.merge(graphdef, params)
        hidden, _ = policy_forward(model, _micro(batch, k)._replace(routed_experts=None))
        return hidden

    with activation_sharding(activations):
        hidden = jax.lax.map(one, jnp.arange(batch.tokens.shape[0]))
    flat = hidden.reshape(-1, hidden.shape[-1])
    return jax.lax.stop_gradient(jnp.take(flat, index, axis=0))


def _loss_inputs(mb: Any, logprobs, entropy, old, ref, advantages=None) -> LossInputs:
    return LossInputs(
        logprobs=logprobs,
        old_logprobs=old,
        advantages=mb.advantages if advantages is None else advantages,
        loss_mask=mb.loss_mask,
        sequence_ids=mb.sequence_ids,
        token_weights=mb.token_weights,
        ref_logprobs=ref,
        rollout_logprobs=mb.rollout_logprobs,
        entropy=entropy,
    )


def teacher_logprobs(graphdef: nnx.GraphDef, params: Any, mb: Any, *, chunk_size: int) -> jax.Array:
    """--opd-type trainer: the frozen teacher's log-prob [R, T] of each target of one micro-batch, 0 off the loss
    mask, no gradient. At temperature 1 (the teacher's own distribution, as an engine teacher scores). A
    mixture-of-experts teacher routes every token itself: the batch's `routed_experts` are the student's."""
    teacher: PolicyModel = nnx.merge(graphdef, jax.lax.stop_gradient(params))
    if routes_experts(teacher):
        hidden, _ = teacher.forward(mb.tokens, mb.positions, mb.segment_ids, mb.vision, None)
    else:
        hidden = teacher(mb.tokens, mb.positions, mb.segment_ids, mb.vision)
    lp, _ = token_logprobs(teacher, hidden, mb.targets, chunk_size=chunk_size)
    return jnp.where(mb.loss_mask > 0, jax.lax.stop_gradient(lp), jnp.zeros_like(lp))


def opd_terms(mb: Any, old: jax.Array, loss_cfg: LossConfig,
              teacher: jax.Array | None = None) -> tuple[jax.Array | None, dict[str, Metric]]:
    """On-policy distillation (--use-opd): the advantages with -opd_kl_coef * (old - teacher) folded in
    (`rl/opd.py`) and the `opd/*` metrics; the teacher's log-probs are `teacher` (--opd-type trainer, scored in
    the step) or the batch's `teacher_logprobs` (--opd-type engine, stored on the samples); (None, {}) without a
    teacher."""
    if teacher is None:
        teacher = getattr(mb, "teacher_logprobs", None)
    if teacher is None:
        return None, {}
    advantages = opd_advantages(mb.advantages, old, teacher, mb.loss_mask, kl_coef=loss_cfg.opd_kl_coef,
                                only=loss_cfg.opd_only, baseline=loss_cfg.opd_baseline)
    return advantages, opd_metrics(old, teacher, mb.loss_mask)


def train_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    cfg: StepConfig,
    state: TrainState,
    batch: Any,
    old_logprobs: jax.Array | None,
    ref_logprobs: jax.Array | None,
    frozen: Any = None,
    teacher: Any = None,
    *,
    teacher_graphdef: nnx.GraphDef | None = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer update from a [K, R, T] batch (K micro-batches, accumulated in a scan). With LoRA
    (`cfg.lora`), `frozen` is the base parameter state and `state.params` the adapters (all that trains); without,
    `frozen` (when given) is the frozen part of the parameter state, `state.params` the rest. `teacher` (with its
    `teacher_graphdef`): the parameter state of an --opd-type trainer teacher, which scores every micro-batch
    (`teacher_logprobs`) for the OPD fold."""
    with activation_sharding(cfg.activations):
        return _train_step(graphdef, tx, cfg, state, batch, old_logprobs, ref_logprobs, frozen, teacher,
                           teacher_graphdef)


_LOAD = "moe/_load"  # the [L_sparse, E] token counts, summed over micro-batches, turned into `load_metrics`
_DROPPED = "moe/_dropped"


def step_loss(cfg: StepConfig) -> LossFn:
    """The loss the step trains: the `LOSS_TYPES` entry of `cfg.loss_type`."""
    return select_loss(cfg.loss_type, cfg.policy_loss, cfg.custom_loss_path)


def _train_step(graphdef, tx, cfg: StepConfig, state: TrainState, batch, old_logprobs, ref_logprobs, frozen=None,
                teacher=None, teacher_graphdef=None):
    loss_fn = step_loss(cfg)
    num_micro = batch.tokens.shape[0]
    # MoE: the batch's real tokens, to weight each micro-batch's router terms by its share.
    real_total = jnp.maximum(jnp.sum(batch.segment_ids > 0), 1).astype(jnp.float32)

    # The step's randomness (LoRA's rank dropout) comes from `state.rng`, which the step advances: each call draws
    # fresh masks (also the retry of a skipped step), and a resumed run, which restores `rng`, draws the same ones.
    step_key, next_rng = jax.random.split(jax.random.wrap_key_data(state.rng))

    def policy(params, k):
        """The parameter state the model runs with: `params` (joined with the frozen part), or the base adapted by
        them (rank dropout drawn per optimizer step and micro-batch)."""
        if cfg.lora is None:
            return params if frozen is None else join_params(params, frozen)
        return merged_params(frozen, with_rank_dropout(params, cfg.lora, jax.random.fold_in(step_key, k)), cfg.lora)

    self_distill = isinstance(teacher, PrivilegedTeacher)  # --opd-type self: the batch holds the teacher's states

    def micro_loss(params, k):
        mb = _micro(batch, k)
        lp, ent, routing, model, hidden = policy_logprobs(
            graphdef, policy(params, k), mb, chunk_size=cfg.logprob_chunk_size, need_entropy=cfg.need_entropy,
            temperature=cfg.temperature, with_routing=True, with_model=True,
        )
        old = jax.lax.stop_gradient(lp) if cfg.old_from_current else old_logprobs[k]
        ref = None if ref_logprobs is None else ref_logprobs[k]
        if self_distill:
            term, distill = opsd_term(
                hidden, model.lm_head_kernel(), mb.privileged_hidden, teacher, mb.privileged_valid,
                mb.token_weights, beta=cfg.loss.opsd_beta, clip=cfg.loss.opsd_jsd_clip, coef=cfg.loss.opd_kl_coef,
                chunk_size=cfg.logprob_chunk_size, compute_dtype=model.compute_dtype)
            advantages = jnp.zeros_like(mb.advantages) if cfg.loss.opd_only else None
        else:
            scored = None if teacher is None else teacher_logprobs(teacher_graphdef, teacher, mb,
                                                                    chunk_size=cfg.logprob_chunk_size)
            advantages, distill = opd_terms(mb, old, cfg.loss, scored)
            term = 0.0
        loss, metrics = loss_fn(_loss_inputs(mb, lp, ent, old, ref, advantages), cfg.loss)
        loss = loss + term
        metrics = {**metrics, **distill}
        if routing is not None:  # an MoE family: router losses and expert load (a dense one pays nothing)
            valid = mb.segment_ids > 0
            terms = router_terms(routing, valid, jnp.sum(valid) / real_total, top_k=routing.topk_ids.shape[-1],
                                 aux_coef=cfg.loss.router_aux_loss_coef, z_coef=cfg.loss.router_z_loss_coef)
            loss = loss + terms.loss
            metrics = {**metrics, "moe/aux_loss": Metric.sum(terms.aux_loss), "moe/z_loss": Metric.sum(terms.z_loss),
                       _LOAD: Metric.sum(terms.load), _DROPPED: Metric.sum(terms.dropped)}
        return loss, metrics

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def body(carry, k):
        grads_acc, loss_acc, metrics_acc = carry
        (loss, metrics), grads = grad_fn(state.params, k)
        grads_acc = jax.tree.map(jnp.add, grads_acc, grads)
        return (grads_acc, loss_acc + loss, accumulate_metrics(metrics_acc, metrics)), None

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    # The metrics pytree structure comes from one abstract evaluation, so the scan carry is fixed-shape; it starts
    # at each reduction's identity.
    (_, metrics_shape), _ = jax.eval_shape(grad_fn, state.params, 0)
    metrics0 = init_metrics(metrics_shape)
    (grads, loss, metrics_acc), _ = jax.lax.scan(body, (zeros, jnp.zeros((), jnp.float32), metrics0), jnp.arange(num_micro))

    grad_norm = optax.tree.norm(grads)
    # One scalar test: a NaN or inf in any gradient makes the global norm non-finite. A per-leaf
    # `all(isfinite(g))` and-chain gets fused by XLA into every parameter's update fusion (measured: the optimized
    # program of the tiny model grew from 21k to 59k HLO lines, compile 6 s -> 11 s on CPU).
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, new_opt_state = tx.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
    new_state = TrainState(
        params=keep(new_params, state.params),
        opt_state=keep(new_opt_state, state.opt_state),
        step=state.step + finite.astype(jnp.int32),
        rng=jax.random.key_data(next_rng),
    )
    metrics = finalize_metrics(metrics_acc)
    load, dropped = metrics.pop(_LOAD, None), metrics.pop(_DROPPED, None)
    metrics = {k if k.startswith("moe/") else f"train/{k}": v for k, v in metrics.items()}
    if load is not None:
        metrics.update(load_metrics(load, dropped))
    metrics["train/loss_total"] = loss
    metrics["train/grad_norm"] = grad_norm
    metrics["train/skipped_nonfinite"] = 1.0 - finite.astype(jnp.float32)
    return new_state, metrics


def compute_logprobs(
    graphdef: nnx.GraphDef,
    params: Any,
    batch: Any,
    *,
    chunk_size: int,
    temperature: float = 1.0,
    activations: ActivationLayout | None = None,
    with_routing: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Log-probs [K, R, T] of the batch targets under `params` (old or reference policy) at the rollout
    temperature, no gradient. With `with_routing` (an MoE family; --use-routing-replay) also the expert ids this
    forward used, laid out as the batch's `routed_experts` (`used_expert_ids`), for the current forwards to replay."""

    def one(k):
        mb = _micro(batch, k)
        out = policy_logprobs(
            graphdef, params, mb, chunk_size=chunk_size, need_entropy=False, temperature=temperature,
            with_routing=with_routing,
        )
        if not with_routing:
            return out[0]
        lp, _, routing = out
        if routing is None:
            raise ValueError("compute_logprobs(with_routing=True) needs a mixture-of-experts family: this model has "
                             "no router (routing replay does not apply to a dense model)")
        return lp, used_expert_ids(routing, mb.segment_ids)

    with activation_sharding(activations):
        return jax.lax.map(one, jnp.arange(batch.tokens.shape[0]))


def _sharding_devices(shardings: Any) -> set[Any]:
    """Every device the shardings of a pytree place arrays on."""
    return {d for sh in jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
            if isinstance(sh, jax.sharding.Sharding) for d in sh.device_set}


def _with_params(step: Callable[..., Any], params: Any, rest: TrainState, *args: Any) -> Any:
    """`step` on the state `rest` with `params` put back (`compile_train_step` without `donate_params`)."""
    return step(rest._replace(params=params), *args)


def compile_train_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    cfg: StepConfig,
    *,
    state_shardings: Any = None,
    batch_shardings: Callable[[Any], Any] | None = None,
    frozen_shardings: Any = None,
    donate_params: bool = True,
    teacher_graphdef: nnx.GraphDef | None = None,
    teacher_shardings: Any = None,
) -> Callable[..., tuple[TrainState, dict[str, jax.Array]]]:
    """A jitted `step(state, batch, old_logprobs, ref_logprobs, frozen=None, teacher=None)`; the state buffer is
    donated (never `frozen`: LoRA's base or the frozen parameters, placed as `frozen_shardings`; nor `teacher`: an
    --opd-type trainer teacher's parameters of `teacher_graphdef`, placed as `teacher_shardings`). Without
    `donate_params` the parameters are not donated (the rest of the state is): an in-process engine serves them as
    they are (`Trainer.share_params`), and a donated buffer would be deleted under it.

    With shardings, `jax.jit` gets explicit in/out shardings: state as placed, batch rows over (data, fsdp),
    metrics replicated. jit caches one executable per batch shape (a bounded set, from the buckets).
    """
    fn = partial(train_step, graphdef, tx, cfg, teacher_graphdef=teacher_graphdef)
    if not donate_params:  # the parameters as an argument of their own, which is not donated
        fn = partial(_with_params, fn)
    donated = (0,) if donate_params else (1,)

    def args(state):
        return (state,) if donate_params else (state.params, state._replace(params=None))

    if state_shardings is None:
        jitted = jax.jit(fn, donate_argnums=donated)
        return jitted if donate_params else lambda state, *rest: jitted(*args(state), *rest)
    cache: dict[Any, Callable] = {}

    def step(state, batch, old_logprobs=None, ref_logprobs=None, frozen=None, teacher=None):
        key = (jax.tree.structure(batch), tuple(x.shape for x in jax.tree.leaves(batch)), old_logprobs is None, ref_logprobs is None,
               frozen is None, teacher is None)
        if key not in cache:
            b_sh = batch_shardings(batch)
            lp_sh = None if old_logprobs is None else batch_shardings(old_logprobs)
            ref_sh = None if ref_logprobs is None else batch_shardings(ref_logprobs)
            jitted = jax.jit(
                fn,
                in_shardings=(*args(state_shardings), b_sh, lp_sh, ref_sh,
                              None if frozen is None else frozen_shardings,
                              None if teacher is None else teacher_shardings),
                out_shardings=(state_shardings, None),
                donate_argnums=donated,
            )
            if fenced_from_persistent_cache(_sharding_devices(state_shardings)):
                jitted = compile_outside_persistent_cache(
                    jitted, *args(state), batch, old_logprobs, ref_logprobs, frozen, teacher)
            cache[key] = jitted
        return cache[key](*args(state), batch, old_logprobs, ref_logprobs, frozen, teacher)

    step.cache = cache  # type: ignore[attr-defined]
    return step
