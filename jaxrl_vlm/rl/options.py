"""The loss hyper-parameters a user sets, declared once: default, help, bounds and choices (read from the registries).

`LossConfig` (rl/losses.py) extends `LossOptions` with what the trainer derives per batch; the run config composes
these fields into its `algo` section (YAML keys and `--flags` are the field names), and the trainer copies them
by name. A new hyper-parameter is one field here and its use in the loss. No jax here: the config imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxrl_vlm.rl.registries import KL_ESTIMATORS
from rollout.options import opt


@dataclass(frozen=True)
class LossOptions:
    """Static loss hyper-parameters (hashable, like the `LossConfig` built on them)."""

    eps_clip: float = opt(0.2, "Lower PPO clip range (>= 1 switches the lower bound off: canonical CISPO).", ge=0.0)
    eps_clip_high: float | None = opt(None, "Upper PPO clip range (None: equal to --eps-clip; DAPO uses 0.28).", ge=0.0)
    eps_clip_c: float | None = opt(None, "Dual-clip constant (> 1) capping the loss of negative-advantage tokens.",
                                   gt=1.0)
    use_tis: bool = opt(False, "Truncated importance sampling against rollout log-probs.")
    tis_clip: float = opt(2.0, "Upper clip of TIS weights.", gt=0.0)
    tis_clip_low: float = opt(0.0, "Lower clip of TIS weights.", ge=0.0)
    custom_tis_function_path: str | None = opt(
        None,
        "slime's custom TIS/RS function, JAX-native, used with --use-tis in place of the clipped weight: "
        "`fn(pg_loss [B, T], inputs: LossInputs, cfg: LossConfig) -> (pg_loss [B, T], loss_mask [B, T], metrics)` "
        "inside the compiled step; masked-out tokens leave every loss term (the aggregation denominators stay the "
        "host's, unlike slime's rebuilt ones); metrics are per-token [B, T] arrays logged as train/tis/<name>.")
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
