"""Rollout corrections (`--rollout-correction`, rl/corrections.py) against an independent numpy reference.

- Every registry entry's weights, keep-mask and diagnostics equal `_rollout_corrections_ref.reference` (float64,
  one sequence at a time) on packed rows with several sequences, observation holes (loss mask 0), a prompt-only
  sequence, a padding row holding NaN and a sequence whose summed log-ratio passes the +-20 bound.
- The full loss's gradient with each correction, under token and sequence aggregation and for every policy loss,
  is the closed form sum_t w_t * keep_t * (-A_t * r_t * c_t + kl_coef) (no PPO clipping, k1 KL): weights scale
  only the policy gradient, a dropped token leaves the KL term too, icepop's out-of-band tokens keep theirs.
- One case goes through the train step's own loss inputs (`train_step._loss_inputs`) on a real packed batch of
  multi-turn episodes with images in prompts and observations, checked per sample against the unpacked reference.
- The config: slime's spellings, the bounds' errors, the custom hook's pairing, the options listing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _rollout_corrections_ref import reference
from test_batching import build, make_batch_samples

from jaxrl_vlm.config import ConfigError, describe_options, load_config
from jaxrl_vlm.rl.aggregation import aggregation_weights
from jaxrl_vlm.rl.corrections import rollout_correction
from jaxrl_vlm.rl.losses import LossConfig, LossInputs, get_loss
from jaxrl_vlm.rl.metrics import accumulate_metrics, finalize_metrics
from jaxrl_vlm.rl.options import LossOptions
from jaxrl_vlm.rl.registries import ROLLOUT_CORRECTIONS
from jaxrl_vlm.rl.train_step import _loss_inputs

NAMES = ["none", "token_tis", "sequence_tis", "token_mis", "sequence_mis", "icepop", "geo_mask"]
# Bands that keep some and drop (or clip) some of the batch below, both ways.
BANDS = {"none": (0.0, 2.0), "token_tis": (0.6, 1.5), "sequence_tis": (0.8, 1.5), "token_mis": (0.6, 1.5),
         "sequence_mis": (0.8, 1.5), "icepop": (0.6, 1.5), "geo_mask": (0.96, 1.05)}
SHIPPED_HOOK = "configs/hooks/custom_tis.py:masked_is"
B, T = 4, 24
# Rows of (sequence length, prompt length); row 2 is padding; the first sequence of row 3 is prompt-only.
LAYOUT = [[(11, 2), (9, 3)], [(14, 3), (8, 1)], [], [(4, 4), (12, 2), (6, 1)]]
HUGE = 5  # the sequence whose log-ratio sums past +20 (exp clamped)


@pytest.fixture(autouse=True)
def _x64() -> Iterator[None]:
    with jax.enable_x64(True):
        yield


@dataclasses.dataclass
class Packed:
    logp: np.ndarray  # current policy
    old: np.ndarray  # the trainer's behaviour log-probs
    rollout: np.ndarray  # the engine's
    ref: np.ndarray
    adv: np.ndarray
    mask: np.ndarray
    ids: np.ndarray


def packed(seed: int = 0) -> Packed:
    rng = np.random.default_rng(seed)
    mask, adv = np.zeros((B, T)), np.zeros((B, T))
    ids = -np.ones((B, T), np.int32)
    sid = 0
    for row, seqs in enumerate(LAYOUT):
        pos = 0
        for length, prompt in seqs:
            ids[row, pos:pos + length] = sid
            resp = np.arange(pos + prompt, pos + length)
            mask[row, resp] = 1.0
            if len(resp) > 5:  # an observation of two tokens inside the response
                mask[row, resp[len(resp) // 2: len(resp) // 2 + 2]] = 0.0
            adv[row, pos:pos + length] = rng.normal()
            sid, pos = sid + 1, pos + length
    logp = -rng.uniform(0.05, 3.0, size=(B, T))
    old = logp + rng.normal(scale=0.2, size=(B, T))
    drift = rng.normal(scale=0.15, size=sid + 1)[ids]  # per-sequence mismatch, so sequence ratios spread
    rollout = old - drift - rng.normal(scale=0.35, size=(B, T))
    rollout[ids == HUGE] = old[ids == HUGE] - 4.0  # 9 masked tokens: sum 36 > 20
    rollout = np.where(mask > 0, rollout, 0.0)  # the engine reports 0.0 off the loss mask (DESIGN.md, Sample)
    ref = logp + rng.normal(scale=0.3, size=(B, T))
    pad = ids < 0
    for x in (logp, old, ref, adv):
        x[pad] = np.nan  # padding may hold anything: it must never leak
    return Packed(logp, old, rollout, ref, adv, mask, ids)


def corrected(name: str, b: Packed, num_sequences: int | None = 12):
    low, high = BANDS[name]
    return rollout_correction(name, jnp.asarray(b.old), jnp.asarray(b.rollout), jnp.asarray(b.mask),
                              jnp.asarray(b.ids), low=low, high=high, num_sequences=num_sequences)


# ----------------------------------------------------------------------------- values vs numpy


@pytest.mark.parametrize("name", NAMES)
def test_every_correction_and_its_diagnostics_match_numpy(name: str) -> None:
    b = packed()
    got = corrected(name, b)
    weights, keep, metrics = reference(name, b.old, b.rollout, b.mask, b.ids, *BANDS[name])
    np.testing.assert_allclose(np.asarray(got.weights), weights, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(np.asarray(got.keep), keep)
    fin = {k: float(v) for k, v in finalize_metrics(got.metrics).items()}
    assert fin == pytest.approx({f"rollout_corr/{k}": v for k, v in metrics.items()}, rel=1e-10, abs=1e-12)
    # The batch exercises what the entry does: clipping or masking both ways, at token or sequence level.
    m = b.mask > 0
    if name in ("token_tis", "sequence_tis"):
        assert (weights[m] == BANDS[name][0]).any() and (weights[m] == BANDS[name][1]).any()
    if name in ("token_mis", "sequence_mis", "geo_mask"):
        assert 0 < metrics["masked_token_frac"] < 1 and 0 < metrics["masked_seq_frac"] < 1
    if name == "icepop":
        assert (keep[m] == 1).all() and 0 < metrics["masked_token_frac"] < 1
    # Without a sequence bound the ids are bounded by B*T: same result.
    loose = corrected(name, b, num_sequences=None)
    np.testing.assert_array_equal(np.asarray(loose.weights), np.asarray(got.weights))
    assert finalize_metrics(loose.metrics) == finalize_metrics(got.metrics)


def test_sequence_ratios_are_bounded_and_observation_tokens_never_count() -> None:
    b = packed()
    seq = np.asarray(corrected("sequence_mis", b).weights)
    assert np.exp(20.0) > BANDS["sequence_mis"][1]
    assert (seq[b.ids == HUGE] == 0).all()  # exp(min(36, 20)) is out of the band: dropped
    wide = rollout_correction("sequence_tis", jnp.asarray(b.old), jnp.asarray(b.rollout), jnp.asarray(b.mask),
                              jnp.asarray(b.ids), low=0.0, high=1e12, num_sequences=12)
    np.testing.assert_allclose(np.asarray(wide.weights)[(b.ids == HUGE) & (b.mask > 0)], np.exp(20.0), rtol=1e-12)
    # Changing what sits on observation tokens (mask 0) changes nothing.
    hole = (b.ids >= 0) & (b.mask == 0)
    assert hole.any()
    moved = dataclasses.replace(b, old=np.where(hole, b.old + 7.0, b.old), rollout=np.where(hole, -9.0, b.rollout))
    for name in NAMES:
        a, c = corrected(name, b), corrected(name, moved)
        np.testing.assert_array_equal(np.asarray(a.weights), np.asarray(c.weights))
        assert finalize_metrics(a.metrics) == finalize_metrics(c.metrics)


def test_diagnostics_combine_exactly_over_micro_batches() -> None:
    b = packed()
    for name in ("sequence_mis", "icepop"):
        full = finalize_metrics(corrected(name, b).metrics)
        acc = None
        for rows in (slice(0, 1), slice(1, 3), slice(3, 4)):
            part = Packed(**{f: getattr(b, f)[rows] for f in Packed.__dataclass_fields__})
            part.ids = np.where(part.ids >= 0, part.ids - part.ids[part.ids >= 0].min(initial=0), -1).astype(np.int32)
            acc = accumulate_metrics(acc, corrected(name, part).metrics)
        for k, v in finalize_metrics(acc).items():
            assert float(v) == pytest.approx(float(full[k]), rel=1e-12), k


def test_float32_under_jit_matches_numpy() -> None:
    b = packed()
    fn = jax.jit(rollout_correction, static_argnames=("name", "low", "high", "num_sequences"))
    for name in ("sequence_tis", "geo_mask"):
        low, high = BANDS[name]
        got = fn(name=name, train_logprobs=jnp.asarray(b.old, jnp.float32),
                 rollout_logprobs=jnp.asarray(b.rollout, jnp.float32), loss_mask=jnp.asarray(b.mask, jnp.float32),
                 sequence_ids=jnp.asarray(b.ids), low=low, high=high, num_sequences=12)
        weights, _, metrics = reference(name, b.old, b.rollout, b.mask, b.ids, low, high)
        assert got.weights.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got.weights), weights, rtol=1e-5, atol=1e-6)
        fin = finalize_metrics(got.metrics)
        for k, v in metrics.items():
            assert float(fin[f"rollout_corr/{k}"]) == pytest.approx(v, rel=1e-5, abs=1e-6), k


def test_the_mismatch_diagnostics_resolve_a_near_on_policy_gap_in_float32() -> None:
    """An engine and a trainer that agree to ~1e-4 nats (as the embedded engine does): k3 ~ d^2/2 and chi2 ~ 2d
    must come out of float32 as such, not cancel to 0 as exp(d) - 1 - d does."""
    rng = np.random.default_rng(0)
    rollout = rng.normal(-2.0, 0.5, size=(2, 64))
    train = rollout + rng.normal(0.0, 1e-4, size=rollout.shape)
    mask, ids = np.ones_like(rollout), np.repeat(np.arange(2)[:, None], 64, axis=1)
    got = finalize_metrics(rollout_correction(
        "none", jnp.asarray(train, jnp.float32), jnp.asarray(rollout, jnp.float32), jnp.asarray(mask, jnp.float32),
        jnp.asarray(ids), low=0.5, high=2.0, num_sequences=2).metrics)
    d = (np.asarray(train, np.float32) - np.asarray(rollout, np.float32)).astype(np.float64)
    assert float(got["rollout_corr/k3"]) == pytest.approx(np.mean(np.expm1(d) - d), rel=1e-3)
    assert float(got["rollout_corr/k3"]) > 0
    assert float(got["rollout_corr/chi2"]) == pytest.approx(np.mean(np.expm1(2 * d)), rel=1e-3)


# ----------------------------------------------------------------------------- the loss and its gradient


def loss_cfg(name: str, mode: str, **kw) -> LossConfig:
    low, high = BANDS.get(name, (0.6, 1.5))
    # No PPO clipping (eps >= 1 switches the low side off): the closed form below holds on every token.
    return LossConfig(eps_clip=10.0, eps_clip_high=100.0, rollout_correction=name, rollout_correction_low=low,
                      rollout_correction_high=high, use_kl_loss=True, kl_loss_coef=0.3, kl_loss_type="k1",
                      num_sequences=12, aggregation=mode, **kw)


def inputs_of(b: Packed, cfg: LossConfig) -> LossInputs:
    w = aggregation_weights(b.mask, b.ids, cfg.aggregation, cfg.aggregation_constant, dtype=np.float64)
    return LossInputs(logprobs=jnp.asarray(b.logp), old_logprobs=jnp.asarray(b.old), advantages=jnp.asarray(b.adv),
                      loss_mask=jnp.asarray(b.mask), sequence_ids=jnp.asarray(b.ids), token_weights=jnp.asarray(w),
                      ref_logprobs=jnp.asarray(b.ref), rollout_logprobs=jnp.asarray(b.rollout))


def closed_form(policy_loss: str, b: Packed, cfg: LossConfig, w: np.ndarray) -> tuple[float, np.ndarray]:
    """(loss, d loss / d logp) with the reference correction: sum_t w_t keep_t (c_t pg_t + coef * (logp_t - ref_t))."""
    c, keep, _ = reference(cfg.rollout_correction, b.old, b.rollout, b.mask, b.ids, cfg.rollout_correction_low,
                           cfg.rollout_correction_high)
    m = b.mask > 0
    with np.errstate(invalid="ignore"):
        lr = np.where(m, b.logp - b.old, 0.0)
        if policy_loss == "gspo":  # the sequence ratio, its gradient token-local (GSPO-token)
            for s in np.unique(b.ids[m]):
                lr[b.ids == s] = lr[m & (b.ids == s)].mean()
        ratio = np.exp(lr)
        if policy_loss == "cispo":
            pg, dpg = -ratio * b.adv * b.logp, -ratio * b.adv
        else:
            pg, dpg = -ratio * b.adv, -ratio * b.adv
        kw = np.where(m, w * keep, 0.0)
        loss = np.sum(np.where(m, kw * (c * pg + cfg.kl_loss_coef * (b.logp - b.ref)), 0.0))
        grad = np.where(m, kw * (c * dpg + cfg.kl_loss_coef), 0.0)
    return float(loss), grad


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("name", NAMES)
def test_gradient_of_the_loss_with_each_correction_is_the_closed_form(name: str, mode: str) -> None:
    b = packed()
    cfg = loss_cfg(name, mode)
    x = inputs_of(b, cfg)
    value_and_grad = jax.value_and_grad(lambda lp: get_loss("ppo_clip")(dataclasses.replace(x, logprobs=lp), cfg)[0])
    loss, g = value_and_grad(x.logprobs)
    want_loss, want_g = closed_form("ppo_clip", b, cfg, np.asarray(x.token_weights))
    assert float(loss) == pytest.approx(want_loss, rel=1e-10)
    np.testing.assert_allclose(np.asarray(g), want_g, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("policy_loss", ["gspo", "cispo"])
@pytest.mark.parametrize("name", ["sequence_mis", "icepop"])
def test_every_policy_loss_gets_the_correction(policy_loss: str, name: str) -> None:
    b = packed()
    cfg = loss_cfg(name, "seq_mean_token_mean")
    x = inputs_of(b, cfg)
    loss, g = jax.value_and_grad(lambda lp: get_loss(policy_loss)(dataclasses.replace(x, logprobs=lp), cfg)[0])(
        x.logprobs)
    want_loss, want_g = closed_form(policy_loss, b, cfg, np.asarray(x.token_weights))
    assert float(loss) == pytest.approx(want_loss, rel=1e-10)
    np.testing.assert_allclose(np.asarray(g), want_g, rtol=1e-10, atol=1e-14)


def test_the_shipped_hook_is_the_builtin_token_mis() -> None:
    """`--rollout-correction custom` with configs/hooks/custom_tis.py:masked_is equals `token_mis`: one place
    applies either, so loss, gradient and every shared metric agree."""
    b = packed()
    builtin = loss_cfg("token_mis", "token_mean")
    hooked = dataclasses.replace(builtin, rollout_correction="custom", custom_tis_function_path=SHIPPED_HOOK)
    x = inputs_of(b, builtin)

    def run(cfg):
        fn = jax.value_and_grad(lambda lp: get_loss("ppo_clip")(dataclasses.replace(x, logprobs=lp), cfg), has_aux=True)
        (loss, metrics), g = fn(x.logprobs)
        return float(loss), np.asarray(g), {k: float(v) for k, v in finalize_metrics(metrics).items()}

    (l1, g1, m1), (l2, g2, m2) = run(builtin), run(hooked)
    assert l1 == pytest.approx(l2, rel=1e-12)
    np.testing.assert_allclose(g1, g2, rtol=1e-12, atol=1e-15)
    assert set(m2) - set(m1) == {"tis/rejected", "tis/ratio"} and set(m1) - set(m2) == {"rollout_corr/weight_mean"}
    assert {k: m1[k] for k in m2 if k in m1} == pytest.approx({k: v for k, v in m2.items() if k in m1}, rel=1e-12)


# ----------------------------------------------------------------------------- a real packed batch, with images


def test_a_real_packed_batch_with_images_matches_the_per_sample_reference() -> None:
    samples, _ = make_batch_samples(seed=3, n=10, image_rate=0.6)
    assert sum(bool(s.multimodal_train_inputs) for s in samples) >= 3, "too few episodes with images"
    assert any(0 in s.loss_mask for s in samples), "no observation tokens: the test would not see them"
    rng = np.random.default_rng(1)
    adv = rng.normal(size=len(samples))
    batch = build(samples, adv, aggregation="seq_mean_token_mean", row_buckets=[2, 4])
    a, layout = batch.arrays, batch.layout
    assert layout.real_patches > 0  # the images are in the batch the loss sees
    assert a.rollout_logprobs.shape[0] > 1 and max(layout.sequences_per_micro_batch) > a.rollout_logprobs.shape[1]
    # The trainer's log-probs: the engine's plus a per-token mismatch, placed by the layout (targets-aligned).
    old = np.zeros(a.rollout_logprobs.shape)
    per_sample = []
    for p in layout.placements:
        s = samples[p.sample_position]
        slots = p.offset + s.prompt_length - 1 + np.arange(s.response_length)
        np.testing.assert_array_equal(a.rollout_logprobs[p.micro_batch, p.row, slots],
                                      np.asarray(s.rollout_log_probs, np.float32))  # the mapping is right
        mismatch = rng.normal(scale=0.3, size=s.response_length) + rng.normal(scale=0.1)
        trainer = np.asarray(s.rollout_log_probs) + mismatch
        old[p.micro_batch, p.row, slots] = trainer
        per_sample.append((p, slots, s, trainer))
    n_seq = layout.max_sequences_per_micro_batch
    trained = [s for s in samples if any(s.loss_mask)]
    for name in ("sequence_tis", "sequence_mis", "geo_mask", "icepop"):
        low, high = BANDS[name]
        cfg = LossConfig(rollout_correction=name, rollout_correction_low=low, rollout_correction_high=high,
                         num_sequences=n_seq, aggregation="seq_mean_token_mean")
        loss_fn = jax.jit(jax.value_and_grad(lambda lp, mb, o: get_loss("ppo_clip")(
            _loss_inputs(mb, lp, None, o, None), cfg), has_aux=True))
        total, acc, grads = 0.0, None, np.zeros(old.shape)
        for k in range(old.shape[0]):
            mb = jax.tree.map(lambda v: v[k], a)
            o = jnp.asarray(old[k])
            (loss, metrics), g = loss_fn(o, mb, o)  # one optimizer step per rollout: current = old (ratio 1)
            total, acc, grads[k] = total + float(loss), accumulate_metrics(acc, metrics), np.asarray(g)
        # Per sample, unpacked: its own tokens, its own weight 1 / (N * its loss tokens) (seq_mean_token_mean).
        want_loss, rows = 0.0, []
        for p, slots, s, trainer in per_sample:
            mask = np.asarray(s.loss_mask, float)[None]
            c, keep, _ = reference(name, trainer[None], np.asarray(s.rollout_log_probs)[None], mask,
                                   np.zeros_like(mask, np.int32), low, high)
            w = mask / (len(trained) * max(mask.sum(), 1))
            want_loss += float(np.sum(w * keep * c * -adv[p.sample_position]))
            np.testing.assert_allclose(grads[p.micro_batch, p.row, slots], (w * keep * c * -adv[p.sample_position])[0],
                                       rtol=1e-6, atol=1e-9, err_msg=f"{name} {s.name}")
            rows.append((trainer, np.asarray(s.rollout_log_probs), np.asarray(s.loss_mask, float)))
        assert total == pytest.approx(want_loss, rel=1e-6, abs=1e-9), name
        # The diagnostics over every sample's tokens: one row per sample, padded.
        width = max(len(r[0]) for r in rows)
        tr, ro, mk = (np.stack([np.pad(r[j], (0, width - len(r[j]))) for r in rows]) for j in range(3))
        ids = np.where(mk > 0, np.arange(len(rows))[:, None], -1).astype(np.int32)
        _, _, want = reference(name, tr, ro, mk, ids, low, high)
        fin = finalize_metrics(acc)
        for key, v in want.items():
            assert float(fin[f"rollout_corr/{key}"]) == pytest.approx(v, rel=1e-6, abs=1e-9), (name, key)


# ----------------------------------------------------------------------------- config


def test_the_registry_is_what_the_options_offer() -> None:
    assert set(ROLLOUT_CORRECTIONS) == {*NAMES, "custom"}
    field = next(f for f in dataclasses.fields(LossOptions) if f.name == "rollout_correction")
    assert field.metadata["choices"] is ROLLOUT_CORRECTIONS
    assert all(name in field.metadata["help"] for name in ROLLOUT_CORRECTIONS), "the help names every correction"
    listing = describe_options()
    line = next(line for line in listing.splitlines() if "--rollout-correction " in line)
    assert f"choices={ROLLOUT_CORRECTIONS.names()}" in line
    assert any("--rollout-correction-low" in x and ">=0" in x for x in listing.splitlines())
    assert any("--rollout-correction-high" in x and ">0" in x for x in listing.splitlines())


def test_slimes_tis_spellings_map_onto_the_correction(tmp_path) -> None:
    cfg = load_config(None, ["--use-tis", "--tis-clip", "1.5", "--tis-clip-low", "0.25"])
    a = cfg.algo
    assert (a.rollout_correction, a.rollout_correction_low, a.rollout_correction_high) == ("token_tis", 0.25, 1.5)
    assert sum("slime flag --" in n for n in cfg.notes) == 3
    default = load_config(None, []).algo
    assert (default.rollout_correction, default.rollout_correction_low, default.rollout_correction_high) == (
        "none", 0.0, 2.0)  # slime's TIS defaults: --tis-clip 2, --tis-clip-low 0
    # slime's hook replaces its TIS weight: the hook is the correction.
    hooked = load_config(None, ["--use-tis", "--custom-tis-function-path", SHIPPED_HOOK])
    assert hooked.algo.rollout_correction == "custom"
    # The same keys in slime's --custom-config-path YAML; the command line, a later layer, still wins.
    path = tmp_path / "mis.yaml"
    path.write_text("use_tis: true\ntis_clip: 3\n")
    from_yaml = load_config(None, ["--custom-config-path", str(path)]).algo
    assert (from_yaml.rollout_correction, from_yaml.rollout_correction_high) == ("token_tis", 3.0)
    over = load_config(None, ["--custom-config-path", str(path), "--rollout-correction", "icepop"]).algo
    assert (over.rollout_correction, over.rollout_correction_high) == ("icepop", 3.0)
    path.write_text("use_tis: false\n")
    assert load_config(None, ["--custom-config-path", str(path)]).algo.rollout_correction == "none"
    path.write_text("use_tis: true\nrollout_correction: geo_mask\n")
    with pytest.raises(ConfigError, match="use_tis .*and rollout_correction are both set"):
        load_config(None, ["--custom-config-path", str(path)])


@pytest.mark.parametrize(("argv", "message"), [
    (["--rollout-correction-low", "2", "--rollout-correction-high", "1.5"],
     r"--rollout-correction-low 2 must be < --rollout-correction-high 1\.5"),
    (["--tis-clip-low", "3"], r"--rollout-correction-low 3 must be < --rollout-correction-high 2"),
    (["--rollout-correction-low", "-1"], r"rollout_correction_low \(--rollout-correction-low\) must be >= 0"),
    (["--tis-clip", "0"], r"rollout_correction_high \(--rollout-correction-high\) must be > 0"),
    (["--rollout-correction-high", "nan"], r"rollout_correction_high \(--rollout-correction-high\) must be a finite"),
    (["--rollout-correction", "kpop"], r"rollout_correction='kpop' is not one of \['custom', 'geo_mask'"),
    (["--rollout-correction", "custom"], "--rollout-correction custom needs --custom-tis-function-path"),
    (["--custom-tis-function-path", SHIPPED_HOOK], "add --use-tis .* or --rollout-correction custom"),
    (["--rollout-correction", "icepop", "--custom-tis-function-path", SHIPPED_HOOK],
     "would replace the weights and mask of --rollout-correction icepop"),
])
def test_bad_correction_settings_are_config_errors_naming_the_flag(argv, message) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, argv)


def test_loss_config_checks_the_same_rules() -> None:
    with pytest.raises(ValueError, match="--rollout-correction-low 1 must be < --rollout-correction-high 1"):
        LossConfig(rollout_correction="token_mis", rollout_correction_low=1.0, rollout_correction_high=1.0)
    with pytest.raises(ValueError, match="rollout_correction must be one of"):
        LossConfig(rollout_correction="kpop")
    with pytest.raises(ValueError, match="needs --custom-tis-function-path"):
        LossConfig(rollout_correction="custom")
    b = packed()
    x = dataclasses.replace(inputs_of(b, loss_cfg("icepop", "token_mean")), rollout_logprobs=None)
    with pytest.raises(ValueError, match="rollout_correction='icepop' needs LossInputs.rollout_logprobs"):
        get_loss("ppo_clip")(x, loss_cfg("icepop", "token_mean"))
