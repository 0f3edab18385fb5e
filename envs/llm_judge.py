"""LLM-as-judge environment: a judge model grades each model turn and writes the feedback.

Per model turn (`LlmJudgeEnv.step`):

1. The judge prompt is `judge_prompt_template.format(question=..., reference=..., response=...,
   turn=..., max_turns=...)`: `question` is the text items of the sample prompt's user messages
   (joined by newlines; system messages are not sent), `reference` is `sample.label`, `response`
   is the text the model generated in this turn, `turn` is this turn's 1-based number. The prompt
   is one user message rendered with the judge's chat template (generation prompt added) and sent
   as `input_ids` to `/generate` of `judge_url`, an SGLang-API engine (SGLang, sgl-router, or our
   embedded engine), through `rollout.client`.
   Images: when the judge model dir has an image processor (preprocessor_config.json) and
   `judge_send_images` is on, the images of the prompt's user messages come first in that user
   message, in their original order (as in the policy's prompt), and travel exactly as the
   policy's do: `rollout.encoding.ChatEncoder` with the judge's tokenizer and image processor
   gives the ids with one compact `<|image_pad|>` per image and the PNG data URLs for
   `image_data`. The images are decoded once, when the env is built, so a corrupt image fails
   `build_env` naming the sample. A judge without an image processor grades from the text only
   (logged once per judge dir).
2. The reply (the judge's output ids decoded with its tokenizer, special tokens skipped) is parsed
   with the grammar of `parse_judge_reply`: a final line `VERDICT: CORRECT|INCORRECT`, or else a
   last `\\boxed{correct|incorrect}`. The rest of the reply is the feedback.
3. An unparseable reply is re-asked up to `judge_parse_retries` times (default once), with the bad
   reply and `FORMAT_REMINDER` appended to the judge conversation. If it stays unparseable, the turn
   is recorded as `info["verdict"] == "unparseable"`, the policy gets `NEUTRAL_FEEDBACK`, and the
   turn never counts as correct (it leaves `verdict()` unchanged).
4. CORRECT ends the episode; INCORRECT sends "Incorrect." plus the judge's feedback back to the
   policy as a user message; the episode also ends after `max_turns` turns.

Reward: `verdict()` is 1.0/0.0 from the last parseable verdict, None if the judge never gave one
(the rollout then falls back to `reward_fn`, which this module does not define on purpose: only a
judge can grade here, so an episode without a verdict fails loudly). The judge sees only the
model's own text of the turn, and the feedback is not an answer: whole-word occurrences of the
reference in the feedback are replaced by `[redacted]` (`judge_redact_reference`), so the policy
cannot be rewarded for copying an answer the judge leaked.

Failures: an unreachable judge, a 4xx, 5xx after the client's bounded retries, or an aborted judge
request raise `JudgeError` naming the judge URL. `step` changes no state before the judge has
answered, so the env is `recoverable`: the rollout may `reset()` and retry the same turn.

Process-wide state, three caches and nothing else:
- `_JUDGE_CLIENTS` holds one `SGLangClient` (one aiohttp connection pool) per (event loop, judge URL,
  timeout, retry settings). An env takes a lease on its first `step` and gives it back in `close()`;
  the last `close()` closes the pool. `shutdown_judge_clients()` closes every pool of the running
  loop at once (e.g. at the end of a run); an env that steps again afterwards gets a new pool.
- `_judge_tokenizer` caches read-only judge tokenizers by path (loading one takes about a second).
- `_judge_encoder` caches the judge's ChatEncoder (or why it has none) by path, and
  `_TEXT_ONLY_LOGGED` the judge dirs whose "images are not sent" line was already logged.

This package never imports jax.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import string
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envs.base import BaseInteractionEnv, EnvOptions, option, require_max_turns, sample_label, sample_where
from envs.grading import last_boxed_span
from rollout.client import EngineError, RetryPolicy, SGLangClient
from rollout.encoding import ChatEncoder, message_images
from rollout.processing import load_image_processor, load_tokenizer

logger = logging.getLogger(__name__)

TEMPLATE_FIELDS = ("question", "reference", "response", "turn", "max_turns")

DEFAULT_JUDGE_PROMPT_TEMPLATE = (
    "You are grading a student's answer to a question.\n\n"
    "Question:\n{question}\n\n"
    "Reference answer:\n{reference}\n\n"
    "Student's answer (attempt {turn} of {max_turns}):\n{response}\n\n"
    "Decide whether the student's final answer is equivalent to the reference answer. "
    "If it is not, explain the mistake in one or two sentences so the student can fix it, "
    "without revealing the reference answer.\n"
    "End your reply with exactly one line: VERDICT: CORRECT or VERDICT: INCORRECT"
)
FORMAT_REMINDER = (
    "Your reply did not end with a verdict line. Reply again and end with exactly one line: "
    "VERDICT: CORRECT or VERDICT: INCORRECT"
)
NEUTRAL_FEEDBACK = "The grader could not evaluate this answer. Restate your final answer clearly."
CORRECT_FEEDBACK = "Correct."
INCORRECT_PREFIX = "Incorrect."
REDACTED = "[redacted]"
_REPLY_SNIPPET_CHARS = 300

class JudgeError(RuntimeError):
    """The judge could not be asked (unreachable, rejected, aborted). The message names the judge URL."""


# --------------------------------------------------------------------------------------------
# Reply grammar
# --------------------------------------------------------------------------------------------

_VERDICT_LINE = re.compile(r"VERDICT\s*:\s*(CORRECT|INCORRECT)\s*[.!]?", re.IGNORECASE)
_BOXED_VERDICT = re.compile(r"\s*(?:\\text\s*\{\s*)?(correct|incorrect)\s*\}?\s*", re.IGNORECASE)
_THINK_CLOSE = "</think>"


@dataclass(frozen=True)
class JudgeVerdict:
    """A parsed judge reply: `correct`, the free-text `feedback` (verdict removed), and the `form` used."""

    correct: bool
    feedback: str
    form: str  # "verdict_line" | "boxed"


def parse_judge_reply(reply: str) -> JudgeVerdict | None:
    """Parse a judge reply; None when it has no verdict. The grammar, applied in this order:

    1. Everything up to and including the last `</think>` is dropped (a reasoning judge's thoughts
       are neither verdict nor feedback).
    2. Verdict line: the last non-blank line, after removing `*` and backtick characters (markdown
       emphasis) and surrounding whitespace, must fully match `VERDICT\\s*:\\s*(CORRECT|INCORRECT)`
       with an optional trailing `.` or `!`, case-insensitively. A verdict line anywhere else does
       not count: only the final line decides.
    3. Otherwise, boxed: the last `\\boxed{...}` (or `\\fbox{...}`) of the reply must contain exactly
       `correct` or `incorrect` (case-insensitive, surrounding spaces allowed, optionally wrapped in
       `\\text{...}`). A last box holding anything else means no verdict.

    The feedback is the reply without the verdict line (or without the box), stripped.
    """
    if not isinstance(reply, str):
        return None
    cut = reply.rfind(_THINK_CLOSE)
    text = reply[cut + len(_THINK_CLOSE) :] if cut >= 0 else reply
    lines = text.rstrip().split("\n")
    if lines and lines[-1].strip():
        match = _VERDICT_LINE.fullmatch(re.sub(r"[*`]", "", lines[-1]).strip())
        if match is not None:
            feedback = "\n".join(lines[:-1]).strip()
            return JudgeVerdict(match.group(1).upper() == "CORRECT", feedback, "verdict_line")
    box = last_boxed_span(text)
    if box is not None:
        match = _BOXED_VERDICT.fullmatch(box[2])
        if match is not None:
            feedback = (text[: box[0]] + text[box[1] :]).strip()
            return JudgeVerdict(match.group(1).lower() == "correct", feedback, "boxed")
    return None


def redact_reference(feedback: str, reference: str) -> tuple[str, bool]:
    """Replace whole-word, case-insensitive occurrences of `reference` in `feedback` by `[redacted]`.

    "Whole word": not preceded or followed by a letter, digit or underscore, so the reference "3"
    is redacted in "x = 3." but not in "x = 35". Returns (text, whether anything was replaced).
    """
    ref = reference.strip()
    if not ref:
        return feedback, False
    pattern = re.compile(r"(?<!\w)" + re.escape(ref) + r"(?!\w)", re.IGNORECASE)
    out, n = pattern.subn(REDACTED, feedback)
    return out, n > 0


def validate_prompt_template(template: str) -> tuple[str, ...]:
    """The fields `template` uses; ValueError if it is not a valid str.format template over
    TEMPLATE_FIELDS or lacks `{response}` (a judge that never sees the answer cannot grade it)."""
    if not isinstance(template, str) or not template.strip():
        raise ValueError("llm_judge: judge_prompt_template must be a non-empty string")
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ValueError(
            f"llm_judge: judge_prompt_template is not a valid str.format template ({e}); "
            "write literal braces as {{ and }}"
        ) from e
    used: list[str] = []
    for _literal, name, _spec, _conversion in parsed:
        if name is None:
            continue
        base = re.split(r"[.\[]", name, maxsplit=1)[0]
        if base not in TEMPLATE_FIELDS:
            raise ValueError(
                f"llm_judge: judge_prompt_template uses unknown field {{{name}}}; allowed fields are "
                + ", ".join("{" + f + "}" for f in TEMPLATE_FIELDS)
                + " (write literal braces as {{ and }})"
            )
        if base not in used:
            used.append(base)
    if "response" not in used:
        raise ValueError("llm_judge: judge_prompt_template must contain {response} (the model's answer)")
    return tuple(used)


def prompt_question_text(prompt: list[dict[str, Any]] | str) -> str:
    """The question the judge sees: the text items of the prompt's user messages, joined by newlines.

    System messages (tool instructions, personas) are left out; images travel separately
    (`prompt_images`), since the template's `{question}` is text.
    """
    if isinstance(prompt, str):
        return prompt.strip()
    pieces: list[str] = []
    for k, message in enumerate(prompt):
        if not isinstance(message, dict):
            raise TypeError(f"llm_judge: prompt message {k} is a {type(message).__name__}, expected a dict")
        if message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, str):
            pieces.append(content)
        elif isinstance(content, list):
            for item in content:
                if isinstance(item, dict) and item.get("type", "text") == "text" and isinstance(item.get("text"), str):
                    pieces.append(item["text"])
    return "\n".join(p.strip() for p in pieces if p.strip())


def prompt_images(prompt: list[dict[str, Any]] | str) -> list[Any]:
    """The image items of the prompt's user messages, in order (the same messages `{question}` reads)."""
    if isinstance(prompt, str):
        return []
    return message_images([m for m in prompt if isinstance(m, dict) and m.get("role") == "user"])


# --------------------------------------------------------------------------------------------
# Shared judge clients and tokenizers
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class JudgeClientSettings:
    """Everything that makes two envs' judge clients interchangeable (the cache key, besides the loop)."""

    url: str
    timeout_s: float
    max_retries: int
    backoff_s: float


@dataclass
class _Lease:
    client: SGLangClient
    users: int = 0


class _JudgeClientCache:
    """One SGLangClient per (event loop, settings), reference-counted by the envs using it.

    Keyed by loop because an aiohttp pool is bound to the loop it was created in; the loop is held
    weakly, so pools of a finished loop are forgotten with it.
    """

    def __init__(self) -> None:
        self._by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[JudgeClientSettings, _Lease]] = (
            weakref.WeakKeyDictionary()
        )

    def acquire(self, settings: JudgeClientSettings) -> SGLangClient:
        leases = self._by_loop.setdefault(asyncio.get_running_loop(), {})
        lease = leases.get(settings)
        if lease is None:
            backoff = settings.backoff_s
            client = SGLangClient(
                settings.url,
                timeout_s=settings.timeout_s,
                connect_timeout_s=min(10.0, settings.timeout_s),
                retry=RetryPolicy(max_retries=settings.max_retries, backoff_base_s=backoff,
                                  backoff_max_s=max(backoff, 8.0)),
            )
            lease = leases[settings] = _Lease(client)
        lease.users += 1
        return lease.client

    async def release(self, settings: JudgeClientSettings, client: SGLangClient,
                      loop: asyncio.AbstractEventLoop) -> None:
        leases = self._by_loop.get(loop, {})
        lease = leases.get(settings)
        if lease is None or lease.client is not client:
            return  # already closed by shutdown_judge_clients()
        lease.users -= 1
        if lease.users > 0:
            return
        del leases[settings]
        if loop is asyncio.get_running_loop():
            await client.close()
        else:
            logger.warning("llm_judge: judge client for %s released outside its event loop; not closed", settings.url)

    def active(self) -> dict[JudgeClientSettings, tuple[SGLangClient, int]]:
        """Clients of the running loop and their number of users (for tests and diagnostics)."""
        leases = self._by_loop.get(asyncio.get_running_loop(), {})
        return {key: (lease.client, lease.users) for key, lease in leases.items()}

    async def shutdown(self) -> None:
        leases = self._by_loop.pop(asyncio.get_running_loop(), {})
        for lease in leases.values():
            await lease.client.close()


_JUDGE_CLIENTS = _JudgeClientCache()


async def shutdown_judge_clients() -> None:
    """Close every judge connection pool of the running event loop (envs still open get a new one)."""
    await _JUDGE_CLIENTS.shutdown()


def active_judge_clients() -> dict[JudgeClientSettings, tuple[SGLangClient, int]]:
    """The judge clients of the running loop with their user counts."""
    return _JUDGE_CLIENTS.active()


@functools.lru_cache(maxsize=8)
def _judge_tokenizer(path: str) -> Any:
    return load_tokenizer(path)


@functools.lru_cache(maxsize=8)
def _judge_encoder(path: str) -> tuple[ChatEncoder | None, str]:
    """The judge's ChatEncoder (its tokenizer and image processor), or None and why images cannot be sent.

    A dir without preprocessor_config.json, or one the Qwen-VL encoding cannot use (another image
    processor type, a tokenizer without `<|image_pad|>`), keeps the judge text-only, as before images existed.
    """
    if not (Path(path) / "preprocessor_config.json").is_file():
        return None, f"{path} has no preprocessor_config.json (a text-only model)"
    try:
        return ChatEncoder(_judge_tokenizer(path), load_image_processor(path)), ""
    except (ValueError, TypeError, OSError) as e:
        return None, f"its image processing cannot be used ({type(e).__name__}: {e})"


_TEXT_ONLY_LOGGED: set[str] = set()


def _log_text_only_once(path: str, reason: str) -> None:
    if path not in _TEXT_ONLY_LOGGED:
        _TEXT_ONLY_LOGGED.add(path)
        logger.warning("llm_judge: question images are NOT sent to the judge %s: %s; it grades from the text only",
                       path, reason)


def _stop_ids(tokenizer: Any) -> tuple[int, ...]:
    """The judge's end-of-turn ids: its eos and, for ChatML templates, `<|im_end|>`."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    im_end = tokenizer.get_vocab().get("<|im_end|>")
    if im_end is not None and int(im_end) not in ids:
        ids.append(int(im_end))
    return tuple(ids)


# --------------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class JudgeOptions(EnvOptions):
    """The judge settings of one env: this module's `--custom-config-path` keys (CONFIG_KEYS derive from it)."""

    ENV_NAME = "llm_judge"

    judge_url: str | None = option(
        None, "llm_judge: base URL of the judge's SGLang-API server (required).", required=True)
    judge_tokenizer_path: str | None = option(
        None,
        "llm_judge: the judge model's tokenizer dir (tokenizer.json + chat template); the prompt is rendered "
        "with its chat template and sent as input_ids (required).",
        required=True,
    )
    judge_prompt_template: str = option(
        DEFAULT_JUDGE_PROMPT_TEMPLATE,
        "llm_judge: str.format template with {question}, {reference}, {response}, {turn}, {max_turns} "
        "(write literal braces as {{ }}); must contain {response}.",
    )
    judge_max_new_tokens: int = option(512, "llm_judge: max_new_tokens of each judge reply.", ge=1)
    judge_temperature: float = option(0.0, "llm_judge: sampling temperature of the judge (0 = greedy).", ge=0)
    judge_timeout_s: float = option(
        60.0, "llm_judge: seconds allowed per judge HTTP request (keep env_step_timeout above the total).", gt=0)
    judge_max_retries: int = option(
        3, "llm_judge: client re-sends of a judge request after a connection error, timeout or 5xx.", ge=0)
    judge_retry_backoff_s: float = option(
        0.5, "llm_judge: first backoff of those re-sends (doubles each time, max 8 s).", ge=0)
    judge_parse_retries: int = option(1, "llm_judge: re-asks of the judge after a reply without a verdict.", ge=0)
    judge_redact_reference: bool = option(
        True, "llm_judge: replace whole-word occurrences of the reference in feedback.")
    judge_send_images: bool = option(
        True,
        "llm_judge: send the question's images to the judge (only if judge_tokenizer_path also has a Qwen-VL "
        "preprocessor_config.json; otherwise the judge is text-only).",
    )

    def validate(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"args.judge_url must start with http:// or https://, got {self.judge_url!r}")

    @property
    def url(self) -> str:
        """`judge_url` without a trailing slash."""
        assert self.judge_url is not None  # required: checked before validate()
        return self.judge_url.rstrip("/")

    @property
    def tokenizer_path(self) -> str:
        assert self.judge_tokenizer_path is not None  # required
        return self.judge_tokenizer_path

    @property
    def client_settings(self) -> JudgeClientSettings:
        return JudgeClientSettings(self.url, self.judge_timeout_s, self.judge_max_retries, self.judge_retry_backoff_s)


CONFIG_KEYS: dict[str, tuple[Any, Any, str]] = JudgeOptions.config_keys()


class LlmJudgeEnv(BaseInteractionEnv):
    """Each turn is graded by a judge model; see the module docstring for the protocol."""

    # The judge call is stateless and `step` commits nothing before it succeeds.
    recoverable = True

    def __init__(self, question: str, reference: str | None, max_turns: int, options: JudgeOptions,
                 images: list[Any] | tuple[Any, ...] = ()) -> None:
        if not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 1:
            raise ValueError(f"LlmJudgeEnv: max_turns must be a positive int, got {max_turns!r}")
        used = validate_prompt_template(options.judge_prompt_template)
        if "question" in used and not question:
            raise ValueError("LlmJudgeEnv: the judge template uses {question} but the prompt has no user text")
        if "reference" in used and reference is None:
            raise ValueError("LlmJudgeEnv: the judge template uses {reference} but the sample has no label")
        self.question = question
        self.reference = reference
        self.max_turns = max_turns
        self.options = options
        self.tokenizer = _judge_tokenizer(options.tokenizer_path)
        self.stop_ids = _stop_ids(self.tokenizer)
        # Images go to the judge only through an encoder; `image_data` is what every judge request carries.
        self.encoder: ChatEncoder | None = None
        self.image_data: list[str] = []
        self._image_grid: Any = None  # image_grid_thw of image_data, to check the pads of each request
        if images and options.judge_send_images:
            self.encoder, reason = _judge_encoder(options.tokenizer_path)
            if self.encoder is None:
                _log_text_only_once(options.tokenizer_path, reason)
            else:
                # Decoded and preprocessed once per episode, not per request (ImageDecodeError names the bad item).
                items = [{"type": "image", "image": image} for image in images]
                seg = self.encoder.encode_prompt([{"role": "user", "content": items}])
                assert seg.mm_inputs is not None  # encode_prompt always processes a non-empty image list
                self.image_data, self._image_grid = seg.image_data, seg.mm_inputs["image_grid_thw"]
        self._client: SGLangClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self.closed = False
        self.turn = 0
        self.done = False
        self.last_correct: bool | None = None
        self.unparseable_turns = 0
        self.history: list[dict[str, Any]] = []

    # ---- protocol ----------------------------------------------------------------------------

    def reset(self) -> None:
        """Return to the state before the current step; it does NOT restart the episode.

        `step` changes nothing until the judge has answered, so after a failed step the committed
        turns are exactly the pre-step state: the rollout's reset-then-retry repeats that turn.
        A new env (one per episode, from `build_env`) starts at turn 0.
        """

    def verdict(self) -> float | None:
        """1.0/0.0 from the last parseable judge verdict; None if the judge never gave one."""
        if self.last_correct is None:
            return None
        return 1.0 if self.last_correct else 0.0

    async def close(self) -> None:
        """Give back the shared judge client (the last user closes its connection pool). Idempotent."""
        self.closed = True
        client, self._client = self._client, None
        if client is not None and self._client_loop is not None:
            await _JUDGE_CLIENTS.release(self.options.client_settings, client, self._client_loop)
        self._client_loop = None

    def render_prompt(self, response_text: str, turn: int) -> str:
        """The judge's user message for `response_text` as the model's answer in 1-based `turn`."""
        return self.options.judge_prompt_template.format(
            question=self.question, reference="" if self.reference is None else self.reference,
            response=response_text, turn=turn, max_turns=self.max_turns,
        )

    def user_message(self, text: str) -> dict[str, Any]:
        """The judge's first user message: the question's images (if sent), then `text`, as the policy's prompt."""
        if not self.image_data:
            return {"role": "user", "content": text}
        images = [{"type": "image", "image": url} for url in self.image_data]
        return {"role": "user", "content": [*images, {"type": "text", "text": text}]}

    def judge_input_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The judge conversation rendered with the judge's chat template (generation prompt added).

        With images, the ids are the encoder's wire view (one compact pad per image), built as the
        policy's prompt is (`ChatEncoder.encode_prompt`'s render + tokenize), and checked to hold one pad
        per image of `image_data`.
        """
        if self.encoder is not None and self.image_data:
            ids = self.encoder.tokenize(self.encoder.render(messages, add_generation_prompt=True))
            try:
                self.encoder.expand_image_pads(ids, self._image_grid)
            except ValueError as e:
                raise ValueError(f"llm_judge: the judge's chat template ({self.options.tokenizer_path}): {e}") from e
            return ids
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if not isinstance(text, str):
            raise TypeError(f"llm_judge: apply_chat_template(tokenize=False) returned {type(text).__name__}")
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    async def step(self, response_text: str) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        """Ask the judge about this turn's text; returns ({"obs_str", "role"}, done, info).

        Raises JudgeError (naming the judge URL) when the judge cannot be asked; no state changes then.
        """
        self.check_step(response_text)
        turn = self.turn + 1
        client = self._judge_client()
        messages: list[dict[str, Any]] = [self.user_message(self.render_prompt(response_text, turn))]
        parsed: JudgeVerdict | None = None
        http_retries = 0
        attempts = 0
        reply = ""
        loop = asyncio.get_running_loop()
        started = loop.time()
        for attempts in range(1, self.options.judge_parse_retries + 2):
            reply, retries = await self._ask(client, messages, turn)
            http_retries += retries
            parsed = parse_judge_reply(reply)
            if parsed is not None:
                break
            messages = [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": FORMAT_REMINDER}]

        # Commit: nothing above changed the env, so a raise before this point leaves it as it was.
        out_of_turns = turn >= self.max_turns
        redacted = False
        if parsed is None:
            self.unparseable_turns += 1
            verdict, done, text = "unparseable", out_of_turns, NEUTRAL_FEEDBACK
        else:
            self.last_correct = parsed.correct
            feedback = parsed.feedback
            if self.options.judge_redact_reference and self.reference is not None:
                feedback, redacted = redact_reference(feedback, self.reference)
            if parsed.correct:
                verdict, done, text = "correct", True, feedback or CORRECT_FEEDBACK
            else:
                verdict, done = "incorrect", out_of_turns
                text = f"{INCORRECT_PREFIX} {feedback}".strip()
        self.turn = turn
        self.done = done
        info: dict[str, Any] = {
            "turn": turn,
            "verdict": verdict,
            "judge_format": None if parsed is None else parsed.form,
            "judge_attempts": attempts,
            "judge_http_retries": http_retries,
            "judge_latency_s": loop.time() - started,
            "feedback_redacted": redacted,
            "judge_reply": reply[:_REPLY_SNIPPET_CHARS],
        }
        self.history.append(dict(info))
        return {"obs_str": text, "role": "user"}, done, info

    # ---- judge I/O -----------------------------------------------------------------------------

    def _judge_client(self) -> SGLangClient:
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            if self._client is not None:
                raise RuntimeError("LlmJudgeEnv: step called from a different event loop than earlier steps")
            self._client = _JUDGE_CLIENTS.acquire(self.options.client_settings)
            self._client_loop = loop
        return self._client

    async def _ask(self, client: SGLangClient, messages: list[dict[str, Any]], turn: int) -> tuple[str, int]:
        """One judge request; returns (reply text, client-level retries). Raises JudgeError."""
        input_ids = self.judge_input_ids(messages)
        params = {
            "max_new_tokens": self.options.judge_max_new_tokens,
            "temperature": self.options.judge_temperature,
            "stop_token_ids": list(self.stop_ids),
            "skip_special_tokens": True,
        }
        where = f"LLM judge at {self.options.url} (turn {turn} of {self.max_turns})"
        try:
            result = await client.generate(input_ids, image_data=self.image_data, sampling_params=params,
                                           return_logprob=False,
                                           rid=f"judge-t{turn}-{uuid.uuid4().hex[:12]}")
        except EngineError as e:
            raise JudgeError(f"{where} failed: {e}") from e
        if result.finish_reason == "abort":
            raise JudgeError(f"{where}: the judge request was aborted ({result.finish_message or 'no message'})")
        stop = set(self.stop_ids)
        text = self.tokenizer.decode([t for t in result.output_ids if t not in stop], skip_special_tokens=True)
        return text, result.retries


# --------------------------------------------------------------------------------------------
# Module entry point
# --------------------------------------------------------------------------------------------


def build_env(sample: Any, args: Any) -> LlmJudgeEnv:
    """An LlmJudgeEnv for `sample` (question from its prompt, reference from its label) and the judge
    settings in `args` (JudgeOptions, this module's CONFIG_KEYS). Raises naming the sample or the key at fault."""
    max_turns = require_max_turns(args, "llm_judge")
    options = JudgeOptions.from_args(args)
    label = sample_label(sample)
    reference = None if label is None else str(label)
    try:
        prompt = getattr(sample, "prompt", "")
        question = prompt_question_text(prompt)
        return LlmJudgeEnv(question, reference, max_turns, options, images=prompt_images(prompt))
    except (ValueError, TypeError) as e:
        kind = TypeError if isinstance(e, TypeError) else ValueError
        raise kind(f"llm_judge build_env: {sample_where(sample)}: {e}") from e
