"""The loss hyper-parameters a user sets, declared once: default, help, bounds and choices (read from the registries).

`LossConfig` (rl/losses.py) extends `LossOptions` with what the trainer derives per batch; the run config composes
these fields into its `algo` section (YAML keys and `--flags` are the field names), and the trainer copies them
by name. A new hyper-parameter is one field here and its use in the loss. No jax here: the config imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxrl_vlm.rl.registries import KL_ESTIMATORS, ROLLOUT_CORRECTIONS
from rollout.options import opt


#: --opd-baseline's values (rl/opd.py `opd_baseline` says what each subtracts).
OPD_BASELINES = ("none", "mean")


@dataclass(frozen=True)
class LossOptions:
    """Static loss hyper-parameters (hashable, like the `LossConfig` built on them)."""

    eps_clip: float = opt(0.2, "Lower PPO clip range (>= 1 switches the lower bound off: canonical CISPO).", ge=0.0)
    eps_clip_high: float | None = opt(None, "Upper PPO clip range (None: equal to --eps-clip; DAPO uses 0.28).", ge=0.0)
    eps_clip_c: float | None = opt(None, "Dual-clip constant (> 1) capping the loss of negative-advantage tokens.",
                                   gt=1.0)
    rollout_correction: str = opt(
        "none",
        "Correction for the gap between the engine's log-probs and the trainer's (rl/corrections.py), applied to the "
        "per-token loss of every --policy-loss; r = exp(trainer - rollout) per token, [low, high] = "
        "[--rollout-correction-low, --rollout-correction-high]. none: no correction (diagnostics only); token_tis: "
        "weight clip(r, low, high) (slime's --use-tis); sequence_tis: weight clip(product of the sequence's r, low, "
        "high); token_mis / sequence_mis: tokens / sequences whose ratio is outside [low, high] leave the loss, the "
        "rest weigh their ratio; icepop: policy-gradient weight r inside [low, high], 0 outside (e.g. 0.5, 5); "
        "geo_mask: sequences whose geometric-mean ratio is outside [low, high] leave the loss (e.g. 0.999, 1.001); "
        "custom: the --custom-tis-function-path hook. Sequences are the packed ones, over loss-mask tokens only. "
        "Logged as train/rollout_corr/{k3,chi2,masked_token_frac,masked_seq_frac,weight_mean}.",
        choices=ROLLOUT_CORRECTIONS)
    rollout_correction_low: float = opt(
        0.0, "Lower bound of --rollout-correction's ratio band: the truncation floor of token_tis / sequence_tis, "
        "the low edge of the masks (slime's --tis-clip-low); must be < --rollout-correction-high.", ge=0.0)
    rollout_correction_high: float = opt(
        2.0, "Upper bound of --rollout-correction's ratio band: the truncation cap of token_tis / sequence_tis, the "
        "high edge of the masks (slime's --tis-clip).", gt=0.0)
    custom_tis_function_path: str | None = opt(
        None,
        "slime's custom TIS/RS function, JAX-native, with --rollout-correction custom (slime's --use-tis also "
        "selects it when this path is set): `fn(pg_loss [B, T], inputs: LossInputs, cfg: LossConfig) -> (pg_loss "
        "[B, T], loss_mask [B, T], metrics)` inside the compiled step, in place of a correction's weights and mask; "
        "masked-out tokens leave every loss term (the aggregation denominators stay the host's, unlike slime's "
        "rebuilt ones); metrics are per-token [B, T] arrays logged as train/tis/<name>.")
    opd_kl_coef: float = opt(
        1.0, "On-policy distillation (--use-opd): each loss-mask token's advantage gets -coef * (student - teacher "
        "log-prob), the student's being the trainer's behaviour log-prob (old_logprobs), after any estimator, as "
        "slime's --opd-kl-coef. Logged as train/opd/{reverse_kl,teacher_logprob,student_logprob}.", ge=0.0)
    opd_only: bool = opt(
        False, "With --use-opd: the reverse KL is the only signal (advantage = -coef * (student - teacher) per "
        "token; the reward's advantages are dropped), pure on-policy distillation.")
    opd_baseline: str = opt(
        "none", "With --use-opd: the baseline subtracted from each token's reverse KL before it is folded in. none: "
        "slime's uncentred term; mean: the micro-batch's mean reverse KL over loss-mask tokens (the expected "
        "gradient is unchanged, and sampled tokens are no longer pushed down on average, which otherwise moves "
        "mass to tokens the engine never samples). See rl/opd.py.", choices=OPD_BASELINES)
    opsd_beta: float = opt(
        0.5, "--opd-type self (slime's --opsd-beta): the generalized JSD's mixture weight, M = beta * student + (1 - "
        "beta) * teacher; 0 is KL(teacher || student), 1 is KL(student || teacher).", ge=0.0, le=1.0)
    opsd_jsd_clip: float = opt(
        0.05, "--opd-type self (slime's --opsd-jsd-clip): each token's JSD is clipped from above at this value (a "
        "clipped token gives no gradient). Logged as train/opd/{jsd,jsd_clipped_frac}.", gt=0.0)
    use_kl_loss: bool = opt(False, "Add a KL(policy || reference) loss term.")
    kl_loss_coef: float = opt(0.0, "Coefficient of the KL loss term.", ge=0.0)
    kl_loss_type: str = opt("k1", "KL estimator of the KL loss (slime's default k1).", choices=KL_ESTIMATORS)
    entropy_coef: float = opt(0.0, "Entropy bonus coefficient.", ge=0.0)
    # Mixture-of-experts families only (a dense model has no router: these cost nothing there).
    router_aux_loss_coef: float = opt(
        0.0, "MoE: coefficient of the router load-balancing loss (transformers' load_balancing_loss_func over every "
        "sparse layer's real tokens) added to the policy loss.", ge=0.0)
    router_z_loss_coef: float = opt(
        0.0, "MoE: coefficient of the router z-loss (ST-MoE): mean over sparse layers and real tokens of "
        "logsumexp(router logits)^2, added to the policy loss.", ge=0.0)


CUSTOM_CORRECTION = "custom"  # the ROLLOUT_CORRECTIONS entry of the --custom-tis-function-path hook


def rollout_correction_problem(name: str, low: float, high: float, custom_tis_function_path: str | None) -> str | None:
    """What is wrong with a rollout correction's settings, in words naming the flags (None: nothing). One rule for
    the run config (a ConfigError) and `LossConfig` (a ValueError)."""
    if not low < high:
        return (f"--rollout-correction-low {low:g} must be < --rollout-correction-high {high:g} (slime's "
                "--tis-clip-low and --tis-clip)")
    if custom_tis_function_path is not None and name != CUSTOM_CORRECTION:
        if name == "none":
            return (f"--custom-tis-function-path {custom_tis_function_path} replaces the weights of a rollout "
                    "correction, which is off: add --use-tis (slime's spelling) or --rollout-correction custom")
        return (f"--custom-tis-function-path {custom_tis_function_path} would replace the weights and mask of "
                f"--rollout-correction {name}: name --rollout-correction custom (the hook is the correction)")
    if name == CUSTOM_CORRECTION and custom_tis_function_path is None:
        return "--rollout-correction custom needs --custom-tis-function-path (the function that is the correction)"
    return None


def opd_problem(use_opd: bool, opd_type: str, teacher_url: str | None, teacher_checkpoint: str | None,
                opd_only: bool, kl_coef: float) -> str | None:
    """What is wrong with the on-policy distillation settings, in words naming the flags (None: nothing)."""
    if not use_opd:
        set_here = [flag for flag, on in (("--opd-teacher-url", teacher_url is not None),
                                          ("--opd-teacher-checkpoint", teacher_checkpoint is not None),
                                          ("--opd-only", opd_only)) if on]
        if not set_here:
            return None
        return f"{', '.join(set_here)} {'needs' if len(set_here) == 1 else 'need'} --use-opd"
    if opd_type == "self":
        given = [flag for flag, v in (("--opd-teacher-url", teacher_url), ("--opd-teacher-checkpoint",
                                                                          teacher_checkpoint)) if v is not None]
        if given:
            return (f"--opd-type self is the frozen initial policy with privileged information: {', '.join(given)} "
                    "names another teacher (use --opd-type engine or trainer for it)")
    elif opd_type == "trainer":
        if teacher_url is not None:
            return (f"--opd-type trainer runs the teacher inside the trainer from --opd-teacher-checkpoint; "
                    f"--opd-teacher-url {teacher_url} is a served teacher: use --opd-type engine for it")
        if teacher_checkpoint is None:
            return ("--use-opd --opd-type trainer needs --opd-teacher-checkpoint (the HF directory of the teacher, "
                    "which shares the student's tokenizer)")
    elif (teacher_url is None) == (teacher_checkpoint is None):
        return ("--use-opd --opd-type engine needs exactly one teacher: --opd-teacher-url (an SGLang, vLLM or "
                "`jaxrl-vlm serve` server) or --opd-teacher-checkpoint (an embedded teacher engine)")
    if opd_only and kl_coef == 0.0:
        return "--opd-only with --opd-kl-coef 0 leaves no signal to train on: set --opd-kl-coef > 0"
    return None
