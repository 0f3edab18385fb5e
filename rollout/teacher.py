"""On-policy distillation's teacher scoring (`--use-opd --opd-type engine`): a rollout-side step.

Once an episode has finished, the teacher scores the student's whole trajectory (the prompt, every turn, the
observations and every picture of the episode) in one request for the engine's prompt log-probs: SGLang's
`/generate` with `logprob_start_len: 0`, `max_new_tokens: 0` (`SGLangClient.prompt_logprobs`), or vLLM's token route
with `sampling_params.prompt_logprobs: 0` (`VLLMClient.prompt_logprobs`); --opd-teacher-api says which, or the server
is asked (`connect_teacher`). The log-prob of each response token goes on the sample (`Sample.teacher_log_probs`,
0.0 on observation tokens as `rollout_log_probs`), so the rollout dump, saved rollouts and their replay carry it;
the trainer folds it into the advantages (`jaxrl_vlm/rl/opd.py`). The teacher scores at temperature 1 (its own
distribution), as slime's teacher request (temperature 0, which SGLang reports untempered) does.

No jax here: a rollout host runs it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from rollout import vllm_wire
from rollout.client import EngineError, EngineRefused, SGLangClient
from rollout.encoding import ChatEncoder
from rollout.sample import Sample
from rollout.vllm_client import ENGINE_APIS, client_class, detect_engine_api


class TeacherError(RuntimeError):
    """The teacher could not score an episode (its answer does not fit the trajectory); names the sample."""


class TeacherUnavailable(EngineRefused):
    """The teacher at --opd-teacher-url cannot serve the run: nothing healthy answers there, or it does not score
    prompts (a vLLM without its token route, an engine that refuses prompt log-probs). Bad input, reported in one
    line like `EngineRefused`; the message names the URL, the protocol and the cause."""


TEACHER_TEMPERATURE = 1.0


def response_teacher_logprobs(sample: Sample, position_logprobs: list[float]) -> list[float]:
    """The teacher's log-prob of each response token of `sample` from its prompt log-probs (`position_logprobs[i-1]`
    = log p(tokens[i] | tokens[:i]), len(tokens) - 1 of them), 0.0 where the loss mask is 0."""
    expected = len(sample.tokens) - 1
    if len(position_logprobs) != expected:
        raise TeacherError(f"{sample.name}: the teacher scored {len(position_logprobs) + 1} positions, the trajectory "
                           f"has {len(sample.tokens)} (tokens with image pads expanded): is it the student's model "
                           "family with the same tokenizer and image processor?")
    start = sample.prompt_length - 1  # the first response token is predicted at position prompt_length
    return [float(position_logprobs[start + j]) if m else 0.0 for j, m in enumerate(sample.loss_mask)]


@dataclass
class TeacherScorer:
    """A teacher engine behind its client (`SGLangClient`, or `VLLMClient` for a vLLM teacher), with at most
    `concurrency` scoring requests in flight.

    `encoder` compacts the trajectory's expanded image pads back to one per image, as the wire wants them.
    """

    client: SGLangClient
    encoder: ChatEncoder
    concurrency: int = 8
    timeout_s: float | None = None
    _slots: asyncio.Semaphore = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._slots = asyncio.Semaphore(self.concurrency)

    async def score(self, sample: Sample) -> None:
        """Set `sample.teacher_log_probs`; TeacherError (or the client's EngineError) when it cannot."""
        if sample.video_data:  # the wire view of a clip's timestamps and frame groups is not rebuilt from tokens yet
            raise TeacherError(f"{sample.name}: a teacher cannot score an episode with clips yet (docs/guides/video.md)")
        wire_ids = self.encoder.compact_image_pads(sample.tokens)
        async with self._slots:
            position_lps = await self.client.prompt_logprobs(wire_ids, image_data=sample.image_data or None,
                                                             temperature=TEACHER_TEMPERATURE, timeout_s=self.timeout_s)
        sample.teacher_log_probs = response_teacher_logprobs(sample, position_lps)

    async def close(self) -> None:
        await self.client.close()


TEACHER_ERRORS = (TeacherError, EngineError, asyncio.TimeoutError)

# A teacher is checked once at attach with a prompt of plain ids every vocabulary has: it must answer one log-prob
# per position after the first.
PROBE_IDS = vllm_wire.PROBE_PROMPT


async def connect_teacher(url: str, api: str, *, start_timeout_s: float, **client_options) -> SGLangClient:
    """The client of the teacher at `url` (--opd-teacher-url) in its protocol (`api`: sglang, vllm, or auto: asked
    of the server as `--engine-api auto` does), once it is healthy and has scored a probe prompt.
    `TeacherUnavailable` names what is wrong: nothing healthy within `start_timeout_s`, a server that is neither
    engine, or one that answers the probe with an error or the wrong number of log-probs."""
    if api not in ("auto", *ENGINE_APIS):
        raise ValueError(f"--opd-teacher-api {api!r}: choose auto or one of {ENGINE_APIS}")
    flag = f"the OPD teacher at {url} (--opd-teacher-url)"
    # SGLang's health probe falls back to /health, which vLLM answers: it serves both before the protocol is known.
    client = client_class("sglang" if api == "auto" else api)(url, **client_options)
    try:
        try:
            await client.wait_healthy(timeout_s=start_timeout_s)
        except EngineError as exc:
            raise TeacherUnavailable(url, f"{flag} is unreachable: {exc}") from exc
        if api == "auto":
            try:
                api = await detect_engine_api(url, api_key=client_options.get("api_key"))
            except EngineError as exc:
                raise TeacherUnavailable(url, f"{flag} is neither SGLang nor vLLM: {exc}; set "
                                              "--opd-teacher-api") from exc
            await client.close()
            client = client_class(api)(url, **client_options)
        try:
            scored = await client.prompt_logprobs(list(PROBE_IDS), temperature=TEACHER_TEMPERATURE)
        except EngineError as exc:
            advice = (" (a vLLM teacher needs its token route: start it with --enable-scale-out)"
                      if api == "vllm" and exc.status == 404 else "")
            raise TeacherUnavailable(url, f"{flag} does not score prompts with {api}'s prompt log-probs{advice}: "
                                          f"{exc}") from exc
        if len(scored) != len(PROBE_IDS) - 1:
            raise TeacherUnavailable(url, f"{flag} scored {len(scored)} positions of a {len(PROBE_IDS)}-token probe "
                                          f"prompt, not {len(PROBE_IDS) - 1} ({api}'s protocol)")
    except BaseException:
        await client.close()
        raise
    return client
