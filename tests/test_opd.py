"""On-policy distillation (`--use-opd`, rl/opd.py, rollout/teacher.py) against an independent numpy reference.

- The OPD advantage A - c * (student - teacher) on loss-mask tokens (or -c * (student - teacher) alone with
  --opd-only) and its metrics equal numpy (float64) on packed rows with observation holes and NaN padding.
- The loss's gradient with the OPD advantage is the closed form under token and sequence aggregation.
- A real packed batch of multi-turn episodes with images: the teacher's log-probs land on the right slots, and the
  train step's own OPD terms (`train_step.opd_terms`) give per sample the unpacked reference's gradient.
- The sample carries the teacher's log-probs through validation, serialization and the rollout dump; the teacher's
  prompt log-probs map onto the response tokens; the config's slime spellings and errors.
- A vLLM teacher's protocol against a fake server: found by `--opd-teacher-api auto`, probed at attach, scoring with
  the pictures as `content_parts`; an unreachable teacher and a vLLM without its token route are refused by name.
(The embedded engine's prompt log-probs against the trainer's forward: tests/test_engine.py; a real vLLM teacher
against the embedded one: tests/vllm_real/test_vllm_teacher.py.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_batching import build, make_batch_samples
from test_rollout_corrections import B, T, packed

from jaxrl_vlm.config import ConfigError, load_config
from jaxrl_vlm.rl.aggregation import aggregation_weights
from jaxrl_vlm.rl.losses import LossConfig, LossInputs, get_loss
from jaxrl_vlm.rl.metrics import accumulate_metrics, finalize_metrics
from jaxrl_vlm.rl.opd import clipped_jsd, opd_advantages, opd_metrics
from jaxrl_vlm.rl.train_step import _loss_inputs, opd_terms
from rollout.sample import Sample, SampleError, Status
from rollout.teacher import TeacherError, response_teacher_logprobs

COEF = 0.7


@pytest.fixture(autouse=True)
def _x64() -> Iterator[None]:
    with jax.enable_x64(True):
        yield


def numpy_opd(adv, student, teacher, mask, coef, only, baseline="none"):
    """The reference: slime's A - coef * (student - teacher) per loss-mask token; only: the KL term alone;
    baseline "mean": the loss-mask tokens' mean reverse KL is subtracted from each token's first."""
    m = mask > 0
    with np.errstate(invalid="ignore"):
        rkl = np.where(m, student - teacher, 0.0)
        b = rkl[m].mean() if baseline == "mean" else 0.0
        base = np.zeros_like(adv) if only else adv
        out = np.where(m, base - coef * (rkl - b), base)
    n = m.sum()
    metrics = {"opd/reverse_kl": rkl[m].sum() / n, "opd/teacher_logprob": teacher[m].sum() / n,
               "opd/student_logprob": student[m].sum() / n}
    return out, metrics


def with_teacher(seed: int = 0):
    b = packed(seed)
    rng = np.random.default_rng(seed + 10)
    teacher = np.where(b.mask > 0, b.old - rng.normal(scale=0.5, size=(B, T)), 0.0)
    return b, teacher


@pytest.mark.parametrize(("only", "baseline"), [(False, "none"), (True, "none"), (False, "mean"), (True, "mean")])
def test_opd_advantage_and_metrics_match_numpy(only: bool, baseline: str) -> None:
    b, teacher = with_teacher()
    got = opd_advantages(jnp.asarray(b.adv), jnp.asarray(b.old), jnp.asarray(teacher), jnp.asarray(b.mask),
                         kl_coef=COEF, only=only, baseline=baseline)
    want, want_metrics = numpy_opd(b.adv, b.old, teacher, b.mask, COEF, only, baseline)
    if baseline == "mean" and only:  # centred: the OPD term sums to 0 over the loss-mask tokens
        assert abs(float(np.sum(np.asarray(got)[b.mask > 0]))) < 1e-9
    m = b.mask > 0
    np.testing.assert_allclose(np.asarray(got)[m], want[m], rtol=0, atol=1e-6)
    assert np.isfinite(np.asarray(got)[m]).all()  # NaN padding never leaks into a trained token
    fin = finalize_metrics(opd_metrics(jnp.asarray(b.old), jnp.asarray(teacher), jnp.asarray(b.mask)))
    assert {k: float(v) for k, v in fin.items()} == pytest.approx(want_metrics, abs=1e-6)


def test_opd_metrics_combine_exactly_over_micro_batches() -> None:
    b, teacher = with_teacher(1)
    acc = None
    for rows in (slice(0, 1), slice(1, 3), slice(3, 4)):
        acc = accumulate_metrics(acc, opd_metrics(jnp.asarray(b.old[rows]), jnp.asarray(teacher[rows]),
                                                  jnp.asarray(b.mask[rows])))
    _, want = numpy_opd(b.adv, b.old, teacher, b.mask, COEF, False)
    assert {k: float(v) for k, v in finalize_metrics(acc).items()} == pytest.approx(want, abs=1e-9)


@pytest.mark.parametrize(("only", "baseline"), [(False, "none"), (True, "none"), (True, "mean")])
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean"])
def test_gradient_with_the_opd_advantage_is_the_closed_form(mode: str, only: bool, baseline: str) -> None:
    """No clipping: d loss / d logp_t = -w_t * ratio_t * A'_t, with A' the numpy OPD advantage (a constant)."""
    b, teacher = with_teacher()
    cfg = LossConfig(eps_clip=10.0, eps_clip_high=100.0, num_sequences=12, aggregation=mode, opd_kl_coef=COEF,
                     opd_only=only, opd_baseline=baseline)
    w = aggregation_weights(b.mask, b.ids, mode, None, dtype=np.float64)
    adv = opd_advantages(jnp.asarray(b.adv), jnp.asarray(b.old), jnp.asarray(teacher), jnp.asarray(b.mask),
                         kl_coef=cfg.opd_kl_coef, only=cfg.opd_only, baseline=cfg.opd_baseline)
    x = LossInputs(logprobs=jnp.asarray(b.logp), old_logprobs=jnp.asarray(b.old), advantages=adv,
                   loss_mask=jnp.asarray(b.mask), sequence_ids=jnp.asarray(b.ids), token_weights=jnp.asarray(w))
    loss, g = jax.value_and_grad(lambda lp: get_loss("ppo_clip")(dataclasses.replace(x, logprobs=lp), cfg)[0])(
        x.logprobs)
    want_adv, _ = numpy_opd(b.adv, b.old, teacher, b.mask, COEF, only, baseline)
    m = b.mask > 0
    with np.errstate(invalid="ignore"):
        ratio = np.exp(np.where(m, b.logp - b.old, 0.0))
        want_g = np.where(m, -w * ratio * want_adv, 0.0)
    assert float(loss) == pytest.approx(float(np.sum(np.where(m, want_g, 0.0))), rel=1e-6)
    np.testing.assert_allclose(np.asarray(g), want_g, rtol=1e-6, atol=1e-12)


# ----------------------------------------------------------------------------- a real packed batch, with images


def test_a_real_packed_batch_with_images_matches_the_per_sample_reference() -> None:
    samples, _ = make_batch_samples(seed=3, n=10, image_rate=0.6)
    assert sum(bool(s.multimodal_train_inputs) for s in samples) >= 3, "too few episodes with images"
    rng = np.random.default_rng(2)
    for s in samples:
        lp = np.asarray(s.rollout_log_probs) - np.abs(rng.normal(scale=0.5, size=s.response_length))
        s.teacher_log_probs = [float(v) if m else 0.0 for v, m in zip(lp, s.loss_mask)]
        s.validate()
    adv = rng.normal(size=len(samples))
    batch = build(samples, adv, aggregation="seq_mean_token_mean", row_buckets=[2, 4], teacher_logprobs=True)
    a, layout = batch.arrays, batch.layout
    assert layout.real_patches > 0 and a.teacher_logprobs.shape == a.rollout_logprobs.shape
    assert a.teacher_logprobs.shape[0] > 1  # several micro-batches
    old = np.zeros(a.rollout_logprobs.shape)
    per_sample = []
    for p in layout.placements:
        s = samples[p.sample_position]
        slots = p.offset + s.prompt_length - 1 + np.arange(s.response_length)
        np.testing.assert_array_equal(a.teacher_logprobs[p.micro_batch, p.row, slots],
                                      np.asarray(s.teacher_log_probs, np.float32))  # targets-aligned
        student = np.asarray(s.rollout_log_probs) + rng.normal(scale=0.2, size=s.response_length)
        student = np.where(np.asarray(s.loss_mask) > 0, student, 0.0)
        old[p.micro_batch, p.row, slots] = student
        per_sample.append((p, slots, s, student))
    assert float(np.sum(a.teacher_logprobs * (a.loss_mask == 0))) == 0.0  # nothing off the loss mask
    trained = [s for s in samples if any(s.loss_mask)]
    for only in (False, True):
        cfg = LossConfig(num_sequences=layout.max_sequences_per_micro_batch, aggregation="seq_mean_token_mean",
                         opd_kl_coef=COEF, opd_only=only)

        def loss(lp, mb, o):
            advantages, distill = opd_terms(mb, o, cfg)
            value, metrics = get_loss("ppo_clip")(_loss_inputs(mb, lp, None, o, None, advantages), cfg)
            return value, {**metrics, **distill}

        fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
        acc, grads = None, np.zeros(old.shape)
        for k in range(old.shape[0]):
            mb = jax.tree.map(lambda v: v[k], a)
            o = jnp.asarray(old[k])
            (_, metrics), g = fn(o, mb, o)  # one optimizer step per rollout: current = old (ratio 1)
            acc, grads[k] = accumulate_metrics(acc, metrics), np.asarray(g)
        students, teachers, masks = [], [], []
        for p, slots, s, student in per_sample:
            mask = np.asarray(s.loss_mask, float)
            teacher = np.asarray(s.teacher_log_probs)
            want_adv, _ = numpy_opd(np.full(len(mask), adv[p.sample_position]), student, teacher, mask, COEF, only)
            w = mask / (len(trained) * max(mask.sum(), 1))
            np.testing.assert_allclose(grads[p.micro_batch, p.row, slots], -w * want_adv, rtol=1e-6, atol=1e-9,
                                       err_msg=f"{s.name} only={only}")
            students.append(student), teachers.append(teacher), masks.append(mask)
        _, want = numpy_opd(np.zeros(1), np.concatenate(students), np.concatenate(teachers), np.concatenate(masks),
                            COEF, only)
        fin = finalize_metrics(acc)
        for key, v in want.items():
            assert float(fin[key]) == pytest.approx(v, rel=1e-6, abs=1e-9), key


# ----------------------------------------------------------------------------- OPSD's clipped JSD (rl/opd.py)


def numpy_clipped_jsd(z_s, z_t, beta, clip):
    """The reference in probability space (float64): slime's M = beta * S + (1 - beta) * T, JSD = beta * KL(T || M)
    + (1 - beta) * KL(S || M) (beta 0: KL(T || S), 1: KL(S || T)), clipped at `clip`; and its gradient in the student
    logits from dJ/dS through the softmax Jacobian (0 where clipped)."""
    def softmax(z):
        e = np.exp(z - z.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    s, t = softmax(z_s), softmax(z_t)
    if beta == 0.0:
        jsd, d_s = np.sum(t * np.log(t / s), -1), -t / s
    elif beta == 1.0:
        jsd, d_s = np.sum(s * np.log(s / t), -1), np.log(s / t) + 1.0
    else:
        m = beta * s + (1 - beta) * t
        jsd = beta * np.sum(t * np.log(t / m), -1) + (1 - beta) * np.sum(s * np.log(s / m), -1)
        d_s = (1 - beta) * (np.log(s / m) + 1.0) - beta * (beta * t + (1 - beta) * s) / m
    grad = s * (d_s - np.sum(s * d_s, -1, keepdims=True))
    kept = jsd <= clip
    return np.minimum(jsd, clip), np.where(kept[:, None], grad, 0.0)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_clipped_jsd_and_its_gradient_match_numpy(beta: float) -> None:
    rng = np.random.default_rng(7)
    n, v, clip = 24, 33, 0.05
    z_s = rng.normal(scale=0.4, size=(n, v))
    z_t = z_s + rng.normal(scale=rng.uniform(0.01, 1.5, size=(n, 1)), size=(n, v))  # some tokens past the clip
    w = rng.uniform(0.1, 1.0, size=n)
    want, want_grad = numpy_clipped_jsd(z_s, z_t, beta, clip)
    assert 0 < int(np.sum(want >= clip)) < n, "the clip must bind on some tokens and not on others"

    def loss(zs, zt):
        return jnp.sum(w * clipped_jsd(zs, zt, beta=beta, clip=clip))

    got = clipped_jsd(jnp.asarray(z_s), jnp.asarray(z_t), beta=beta, clip=clip)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-12)
    g_s, g_t = jax.grad(loss, argnums=(0, 1))(jnp.asarray(z_s), jnp.asarray(z_t))
    np.testing.assert_allclose(np.asarray(g_s), w[:, None] * want_grad, rtol=1e-6, atol=1e-12)
    assert not np.any(np.asarray(g_t)), "the teacher is a constant"


def test_a_batch_without_teacher_logprobs_is_refused_by_name() -> None:
    samples, adv = make_batch_samples(seed=4, n=3)
    with pytest.raises(Exception, match="no teacher_log_probs"):
        build(samples, adv, teacher_logprobs=True)


# ----------------------------------------------------------------------------- the sample and the teacher's answer


def scored_sample() -> Sample:
    s = Sample(group_index=1, index=2, tokens=[5, 6, 7, 8, 9, 10, 11], status=Status.COMPLETED)
    s.response_length = 4
    s.loss_mask = [1, 0, 1, 1]
    s.rollout_log_probs = [-0.5, 0.0, -1.0, -0.25]
    return s


def test_teacher_prompt_logprobs_map_onto_the_response_tokens() -> None:
    s = scored_sample()
    positions = [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6]  # log p(token i | tokens[:i]) for i = 1..6
    assert response_teacher_logprobs(s, positions) == [-0.3, 0.0, -0.5, -0.6]
    with pytest.raises(TeacherError, match="scored 6 positions, the trajectory has 7"):
        response_teacher_logprobs(s, positions[:-1])


def test_sample_validates_and_round_trips_teacher_logprobs() -> None:
    s = scored_sample()
    s.teacher_log_probs = [-0.3, 0.0, -0.5, -0.6]
    s.validate()
    assert Sample.from_dict(s.to_dict()).teacher_log_probs == s.teacher_log_probs
    for bad, why in (([-0.3, -1.0, -0.5, -0.6], "where loss_mask is 0"), ([-0.3, 0.0, -0.5], "len"),
                     ([-0.3, 0.0, float("nan"), -0.6], "not a log-prob")):
        s.teacher_log_probs = bad
        with pytest.raises(SampleError, match=why):
            s.validate()


# ----------------------------------------------------------------------------- config


def test_slimes_opd_type_spellings_and_the_teacher_options(tmp_path) -> None:
    cfg = load_config(None, ["--use-opd", "--opd-type", "sglang", "--opd-teacher-url", "http://teacher:30000",
                             "--opd-kl-coef", "0.5"])
    assert (cfg.rollout.opd_type, cfg.algo.opd_kl_coef) == ("engine", 0.5)
    assert any("opd_type sglang (slime's spelling) -> engine" in n for n in cfg.notes)
    cfg = load_config(None, ["--use-opd", "--opd-type", "megatron", "--opd-teacher-checkpoint", str(tmp_path)])
    assert (cfg.rollout.opd_type, cfg.rollout.opd_teacher_checkpoint) == ("trainer", str(tmp_path))
    assert any("opd_type megatron (slime's spelling) -> trainer" in n for n in cfg.notes)


@pytest.mark.parametrize("argv, message", [
    (["--use-opd"], "needs exactly one teacher"),
    (["--use-opd", "--opd-teacher-url", "u", "--opd-teacher-checkpoint", "c"], "needs exactly one teacher"),
    (["--use-opd", "--opd-type", "megatron", "--opd-teacher-url", "u"], "--opd-type trainer runs the teacher inside"),
    (["--use-opd", "--opd-type", "trainer"], "--opd-type trainer needs --opd-teacher-checkpoint"),
    (["--use-opd", "--opd-type", "self", "--opd-teacher-url", "u"], "--opd-type self .* --opd-teacher-url names another"),
    (["--opd-teacher-url", "u"], "--opd-teacher-url needs --use-opd"),
    (["--use-opd", "--opd-teacher-url", "u", "--opd-only", "--opd-kl-coef", "0"], "leaves no signal"),
    (["--opd-kl-coef", "-1"], "opd_kl_coef"),
])
def test_bad_opd_settings_are_one_line_config_errors(argv, message) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        load_config(None, argv)
    assert "\n" not in str(e.value)


def test_saved_rollouts_and_the_dump_carry_the_teacher_beside_the_student(tmp_path, tiny_tokenizer) -> None:
    from jaxrl_vlm.viewer.records import _turn
    from jaxrl_vlm.viewer.render import _tokens
    from rollout.driver import RolloutResult
    from rollout.dump import dump_samples, validate_dump
    from rollout.rollout_data import read_rollout_data, write_rollout_data

    s = scored_sample()
    s.teacher_log_probs = [-0.3, 0.0, -0.5, -0.6]
    saved = write_rollout_data(tmp_path / "step_0.jsonl", 0, RolloutResult(groups=[[s]]))
    assert read_rollout_data(saved).result.groups[0][0].teacher_log_probs == s.teacher_log_probs  # replay has it
    assert dump_samples([s], tmp_path / "dump.jsonl", tiny_tokenizer) == 1
    (record,) = validate_dump(tmp_path / "dump.jsonl")
    rows = [(row[1], t) for turn in record["turns"] for row, t in zip(turn["tokens"], turn["teacher_logprobs"])]
    assert rows == [(1, -0.3), (0, None), (1, -0.5), (1, -0.6)]
    html = _tokens(_turn(record["turns"][0], tmp_path))
    assert "log p = -0.5000" in html and "teacher log p = -0.3000" in html


# ----------------------------------------------------------------------------- a vLLM teacher's protocol (no server)


class _FakeVLLMTeacher:
    """vLLM's routes a teacher needs: /health, /v1/models (owner vllm) and the token route answering prompt log-probs
    in vLLM's shape, log p(token i) = -0.1 * i. `token_route=False`: a vLLM started without --enable-scale-out."""

    def __init__(self, token_route: bool = True) -> None:
        self.token_route, self.bodies = token_route, []

    async def __aenter__(self) -> str:
        from aiohttp import web

        async def generate(request):
            body = await request.json()
            self.bodies.append(body)
            ids = body["token_ids"]
            return web.json_response({
                "request_id": body["request_id"], "usage": {"prompt_tokens": len(ids)}, "prompt_token_ids": ids,
                "prompt_logprobs": [None] + [{str(t): {"logprob": -0.1 * i, "rank": 1}} for i, t in enumerate(ids)][1:],
                "choices": [{"index": 0, "finish_reason": "length", "token_ids": [1]}]})

        async def health(request):
            return web.Response()

        async def models(request):
            return web.json_response({"data": [{"id": "t", "owned_by": "vllm"}]})

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", models)
        if self.token_route:
            app.router.add_post("/inference/v1/generate", generate)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()


async def test_a_vllm_teacher_is_detected_probed_and_scores_with_pictures() -> None:
    from rollout.teacher import TeacherScorer, connect_teacher
    from rollout.vllm_client import VLLMClient

    class Encoder:  # the trajectory below has no expanded pads to compact
        compact_image_pads = staticmethod(list)

    fake = _FakeVLLMTeacher()
    async with fake as url:
        client = await connect_teacher(url, "auto", start_timeout_s=5)
        assert isinstance(client, VLLMClient)
        assert fake.bodies[0]["token_ids"] == [1, 2, 3, 4, 5, 6, 7, 8]  # the attach probe
        s = scored_sample()
        s.image_data = ["data:image/png;base64,AAA"]
        scorer = TeacherScorer(client, Encoder())
        await scorer.score(s)
        await scorer.close()
    assert s.teacher_log_probs == pytest.approx([-0.3, 0.0, -0.5, -0.6])
    assert fake.bodies[1]["content_parts"] == [{"type": "image_url", "url": "data:image/png;base64,AAA"}]
    assert fake.bodies[1]["sampling_params"]["prompt_logprobs"] == 0


async def test_an_unreachable_or_routeless_teacher_is_refused_by_name() -> None:
    import socket

    from rollout.teacher import TeacherUnavailable, connect_teacher

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(TeacherUnavailable, match=rf"teacher at http://127.0.0.1:{port} .* is unreachable"):
        await connect_teacher(f"http://127.0.0.1:{port}", "auto", start_timeout_s=0.2)
    async with _FakeVLLMTeacher(token_route=False) as url:
        with pytest.raises(TeacherUnavailable, match="start it with --enable-scale-out"):
            await connect_teacher(url, "vllm", start_timeout_s=5)


def test_the_teacher_api_needs_a_teacher_url() -> None:
    with pytest.raises(ConfigError, match="--opd-teacher-api vllm is the protocol of --opd-teacher-url"):
        load_config(None, ["--use-opd", "--opd-teacher-checkpoint", "c", "--opd-teacher-api", "vllm"])
    cfg = load_config(None, ["--use-opd", "--opd-teacher-url", "http://t:8000", "--opd-teacher-api", "vllm"])
    assert cfg.rollout.opd_teacher_api == "vllm"
