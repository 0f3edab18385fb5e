"""Tiny, deterministic stand-ins for a Qwen3-VL checkpoint's processing files.

Tests and `jaxrl-vlm make-tiny` need a tokenizer, a chat template, an image
processor config and a model config that behave like Qwen3-VL-Instruct's but
are small and built offline (nothing may be fetched from a hub):

- `build_tiny_tokenizer`: a byte-level BPE trained with `tokenizers` on
  generated text, with Qwen's special tokens and added tokens, the same
  normalizer / pre-tokenizer / decoder as Qwen2's tokenizer, eos `<|im_end|>`
  and pad `<|endoftext|>`.
- `QWEN3_VL_CHAT_TEMPLATE`: a Jinja template written for this project that
  renders conversations the way Qwen3-VL-Instruct's template does.
- `QWEN3_THINKING_CHAT_TEMPLATE` / `QWEN3_VL_THINKING_CHAT_TEMPLATE`: the same
  for the Qwen3 thinking templates, which rewrite earlier assistant turns
  (tests of history-rewriting templates; `build_tiny_tokenizer(chat_template=...)`).
- `tiny_image_processor_config`: Qwen3-VL's preprocessing values with a small
  pixel range, so 64x64..128x128 test images stay a few dozen patches.
- `tiny_qwen3_vl_hf_config`: a transformers-5 `Qwen3VLConfig` dict whose token
  ids match the tiny tokenizer.
- Qwen3.5 (`arch="qwen3_5"`): `QWEN3_5_CHAT_TEMPLATE` (thinks by default), Qwen3.5's pre-tokenizer and
  tokenizer class, Qwen3-VL's preprocessing and `tiny_qwen3_5_hf_config` (3 linear : 1 full attention).
- Qwen3-VL-MoE (`arch="qwen3_vl_moe"`): Qwen3-VL's template, tokenizer and preprocessing with
  `tiny_qwen3_vl_moe_hf_config` (one routed MoE layer of 4 experts, top-2, and one dense layer).
- Qwen3.5-MoE (`arch="qwen3_5_moe"`): Qwen3.5's template, tokenizer and preprocessing with
  `tiny_qwen3_5_moe_hf_config` (the tiny Qwen3.5's stack, every MLP 4 routed experts + a gated shared expert).
- Qwen2.5-VL (`arch="qwen2_5_vl"`): `QWEN2_5_VL_CHAT_TEMPLATE` (default system
  prompt, no tool rendering), patch-14 CLIP-normalized preprocessing and
  `tiny_qwen2_5_vl_hf_config`; `TINY_CHAT_TEMPLATES` / `TINY_HF_CONFIGS` map
  each architecture to its pieces.

The files are written in the same format as a released Qwen3-VL checkpoint, so
`rollout.processing.load_tokenizer/load_image_processor` take the same code path
for tiny and real models. This module never imports torch or jax.
"""

from __future__ import annotations

import copy
import json
import math
import random
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors, trainers
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast

from rollout.processing import CLIP_IMAGE_MEAN, CLIP_IMAGE_STD  # Qwen2.5-VL's; tests read it here

# Special tokens in Qwen's id order (a subset: the ones a VL chat model uses).
QWEN_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Qwen registers these as added tokens with special=False: they are single ids
# but survive `skip_special_tokens=True`, so tool-call parsing still sees them.
QWEN_ADDED_TOKENS: tuple[str, ...] = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# Qwen2's pre-tokenization regex (digits split one by one, newline runs kept
# separate), the same one transformers' Qwen2Tokenizer hard-codes.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Qwen3.5's tokenizer (transformers' `Qwen3_5Tokenizer`) keeps combining marks (\p{M}) inside words.
QWEN3_5_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen3-VL-2B-Instruct's model_max_length.
MODEL_MAX_LENGTH = 262144

# Written for this project to reproduce the rendering of Qwen3-VL-Instruct's
# template: no default system prompt; tools listed in the system turn inside
# <tools></tools>; each image/video item renders as ONE compact placeholder
# (the processor / trainer expands the pad); assistant tool calls as
# <tool_call>\n{json}\n</tool_call>; consecutive tool messages share one user
# turn of <tool_response> blocks; every message ends with "<|im_end|>\n".
# Unlike the original it raises on unknown roles and content items instead of
# dropping them silently.
_RENDER_CONTENT_MACRO = r"""{%- set counts = namespace(images=0, videos=0) -%}
{%- macro render_content(content, count_vision) -%}
  {%- if content is string -%}
    {{- content -}}
  {%- elif content is iterable and content is not mapping -%}
    {%- for item in content -%}
      {%- if item.type == 'image' or 'image' in item or 'image_url' in item -%}
        {%- if count_vision -%}{%- set counts.images = counts.images + 1 -%}{%- endif -%}
        {%- if add_vision_id -%}{{- 'Picture ' ~ counts.images ~ ': ' -}}{%- endif -%}
        {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
      {%- elif item.type == 'video' or 'video' in item -%}
        {%- if count_vision -%}{%- set counts.videos = counts.videos + 1 -%}{%- endif -%}
        {%- if add_vision_id -%}{{- 'Video ' ~ counts.videos ~ ': ' -}}{%- endif -%}
        {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
      {%- elif 'text' in item -%}
        {{- item.text -}}
      {%- else -%}
        {{- raise_exception('chat template: unsupported content item ' ~ (item | tojson)) -}}
      {%- endif -%}
    {%- endfor -%}
  {%- elif content is defined and content is not none -%}
    {{- raise_exception('chat template: message content must be a string or a list of items') -}}
  {%- endif -%}
{%- endmacro -%}
"""

QWEN3_VL_CHAT_TEMPLATE = (r"""
{#- Qwen3-VL-Instruct-style chat template (jaxrl-vlm). -#}
""" + _RENDER_CONTENT_MACRO + r"""{%- set has_system = messages | length > 0 and messages[0].role == 'system' -%}
{%- if tools -%}
  {{- '<|im_start|>system\n' -}}
  {%- if has_system -%}{{- render_content(messages[0].content, false) ~ '\n\n' -}}{%- endif -%}
  {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
  {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
  {%- for tool in tools -%}{{- '\n' ~ (tool | tojson) -}}{%- endfor -%}
  {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within '
      '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
      '<args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif has_system -%}
  {{- '<|im_start|>system\n' ~ render_content(messages[0].content, false) ~ '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
  {%- if message.role == 'system' -%}
    {%- if not loop.first -%}
      {{- '<|im_start|>system\n' ~ render_content(message.content, true) ~ '<|im_end|>\n' -}}
    {%- endif -%}
  {%- elif message.role == 'user' -%}
    {{- '<|im_start|>user\n' ~ render_content(message.content, true) ~ '<|im_end|>\n' -}}
  {%- elif message.role == 'assistant' -%}
    {%- set text = render_content(message.content, true) -%}
    {{- '<|im_start|>assistant\n' ~ text -}}
    {%- for call in message.tool_calls or [] -%}
      {%- if not loop.first or text -%}{{- '\n' -}}{%- endif -%}
      {%- set fn = call.function if call.function is defined else call -%}
      {{- '<tool_call>\n{"name": "' ~ fn.name ~ '", "arguments": ' -}}
      {%- if fn.arguments is string -%}{{- fn.arguments -}}{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}
      {{- '}\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\n' -}}
  {%- elif message.role == 'tool' -%}
    {%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
    {{- '\n<tool_response>\n' ~ render_content(message.content, true) ~ '\n</tool_response>' -}}
    {%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
  {%- else -%}
    {{- raise_exception('chat template: unknown role ' ~ (message.role | tojson)) -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
""").strip()

# Written for this project to reproduce the rendering of Qwen2.5-VL-Instruct's template: a default system
# turn "You are a helpful assistant." when the conversation has none; every message, whatever its role
# (tool messages included), renders as <|im_start|>{role}\n{content}<|im_end|>\n with the same compact
# image placeholders; no tool schemas and no tool-call rendering (the released template has neither).
# Unlike the original it raises on unknown content items instead of dropping them silently.
QWEN2_5_VL_DEFAULT_SYSTEM = "You are a helpful assistant."
QWEN2_5_VL_CHAT_TEMPLATE = (r"""
{#- Qwen2.5-VL-Instruct-style chat template (jaxrl-vlm). -#}
""" + _RENDER_CONTENT_MACRO + r"""{%- for message in messages -%}
  {%- if loop.first and message.role != 'system' -%}
    {{- '<|im_start|>system\n""" + QWEN2_5_VL_DEFAULT_SYSTEM + r"""<|im_end|>\n' -}}
  {%- endif -%}
  {{- '<|im_start|>' ~ message.role ~ '\n' ~ render_content(message.content, true) ~ '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
""").strip()

# Written for this project to reproduce the semantics of the Qwen3 *thinking*
# templates (Qwen3 hybrid, Qwen3-2507-Thinking, Qwen3-VL-Thinking), which are
# NOT append-only. Header, content items, images, tools and tool messages render
# as in QWEN3_VL_CHAT_TEMPLATE. Then:
# - the "last user query" is the last user message whose text is not a wrapped
#   `<tool_response>...</tool_response>`; tool messages never count;
# - an assistant message after that query is rendered with a think block,
#   `<think>\n{reasoning}\n</think>\n\n{answer}`, when it is the last message or
#   has reasoning (so a finished final turn without reasoning gets the empty
#   block `<think>\n\n</think>\n\n`); reasoning comes from `reasoning_content` or
#   from the content's `<think>...</think>` part;
# - an assistant message at or before the last query loses its reasoning;
# - the generation prompt is `<|im_start|>assistant\n`, plus the empty think
#   block when `enable_thinking` is false (Qwen3 hybrid). The VL-Thinking
#   variant below opens `<think>\n` in every generation prompt instead.
_QWEN3_THINKING_BODY = _RENDER_CONTENT_MACRO + r"""{%- macro content_text(content) -%}
  {%- if content is string -%}
    {{- content -}}
  {%- elif content is iterable and content is not mapping -%}
    {%- for item in content -%}{%- if item.text is defined and item.text is string -%}{{- item.text -}}{%- endif -%}{%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- set has_system = messages | length > 0 and messages[0].role == 'system' -%}
{%- if tools -%}
  {{- '<|im_start|>system\n' -}}
  {%- if has_system -%}{{- render_content(messages[0].content, false) ~ '\n\n' -}}{%- endif -%}
  {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
  {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
  {%- for tool in tools -%}{{- '\n' ~ (tool | tojson) -}}{%- endfor -%}
  {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within '
      '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
      '<args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif has_system -%}
  {{- '<|im_start|>system\n' ~ render_content(messages[0].content, false) ~ '<|im_end|>\n' -}}
{%- endif -%}
{#- Index of the last user query (a tool response, as a tool message or wrapped in a user one, is no query). -#}
{%- set query = namespace(index=messages | length - 1, found=false) -%}
{%- for message in messages | reverse -%}
  {%- if not query.found and message.role == 'user' -%}
    {%- set text = content_text(message.content) | string -%}
    {%- if not (text.startswith('<tool_response>') and text.endswith('</tool_response>')) -%}
      {%- set query.index = messages | length - 1 - loop.index0 -%}
      {%- set query.found = true -%}
    {%- endif -%}
  {%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
  {%- if message.role == 'system' -%}
    {%- if not loop.first -%}
      {{- '<|im_start|>system\n' ~ render_content(message.content, true) ~ '<|im_end|>\n' -}}
    {%- endif -%}
  {%- elif message.role == 'user' -%}
    {{- '<|im_start|>user\n' ~ render_content(message.content, true) ~ '<|im_end|>\n' -}}
  {%- elif message.role == 'assistant' -%}
    {%- set turn = namespace(text=render_content(message.content, true) | string, reasoning='') -%}
    {%- if message.reasoning_content is defined and message.reasoning_content is string -%}
      {%- set turn.reasoning = message.reasoning_content -%}
    {%- elif '</think>' in turn.text -%}
      {%- set turn.reasoning = turn.text.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') -%}
      {%- set turn.text = turn.text.split('</think>')[-1].lstrip('\n') -%}
    {%- endif -%}
    {%- if loop.index0 > query.index and (loop.last or turn.reasoning) -%}
      {{- '<|im_start|>assistant\n<think>\n' ~ turn.reasoning.strip('\n') ~ '\n</think>\n\n' ~ turn.text.lstrip('\n') -}}
    {%- else -%}
      {{- '<|im_start|>assistant\n' ~ turn.text -}}
    {%- endif -%}
    {%- for call in message.tool_calls or [] -%}
      {%- if not loop.first or turn.text -%}{{- '\n' -}}{%- endif -%}
      {%- set fn = call.function if call.function is defined else call -%}
      {{- '<tool_call>\n{"name": "' ~ fn.name ~ '", "arguments": ' -}}
      {%- if fn.arguments is string -%}{{- fn.arguments -}}{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}
      {{- '}\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\n' -}}
  {%- elif message.role == 'tool' -%}
    {%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
    {{- '\n<tool_response>\n' ~ render_content(message.content, true) ~ '\n</tool_response>' -}}
    {%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
  {%- else -%}
    {{- raise_exception('chat template: unknown role ' ~ (message.role | tojson)) -}}
  {%- endif -%}
{%- endfor -%}
""".strip()

# Qwen3-style hybrid thinking template: the model opens `<think>` itself;
# `enable_thinking=False` (a template kwarg) closes an empty think block in the
# generation prompt.
QWEN3_THINKING_CHAT_TEMPLATE = (
    "{#- Qwen3-Thinking-style chat template (jaxrl-vlm test fixture). -#}\n"
    + _QWEN3_THINKING_BODY
    + "\n{%- if add_generation_prompt -%}\n"
    "  {{- '<|im_start|>assistant\\n' -}}\n"
    "  {%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}\n"
    "{%- endif -%}"
)

# Qwen3-VL-Thinking-style template: every generation prompt opens `<think>\n`,
# so the model's turn is `{reasoning}\n</think>\n\n{answer}<|im_end|>`.
QWEN3_VL_THINKING_CHAT_TEMPLATE = (
    "{#- Qwen3-VL-Thinking-style chat template (jaxrl-vlm test fixture). -#}\n"
    + _QWEN3_THINKING_BODY
    + "\n{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n<think>\\n' -}}{%- endif -%}"
)

# Qwen3.5's template (its 2B and larger sizes think by default): the chat layout of Qwen3-VL with the thinking
# history rule above, and a generation prompt that opens `<think>\n` unless `enable_thinking` is false, which closes
# an empty think block instead (so the model answers directly).
QWEN3_5_CHAT_TEMPLATE = (
    "{#- Qwen3.5-style chat template (jaxrl-vlm test fixture). -#}\n"
    + _QWEN3_THINKING_BODY
    + "\n{%- if add_generation_prompt -%}\n"
    "  {{- '<|im_start|>assistant\\n' -}}\n"
    "  {%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}\n"
    "  {%- else -%}{{- '<think>\\n' -}}{%- endif -%}\n"
    "{%- endif -%}"
)

# Word lists for the generated training text: the domains the tests talk
# about (geometry problems, chat turns, LaTeX answers, JSON tool calls).
_GEOMETRY_WORDS = """triangle angle circle radius diameter side length area perimeter measure segment
point center chord tangent secant arc sector polygon square rectangle rhombus trapezoid parallelogram
hexagon pentagon vertex vertices altitude median bisector hypotenuse leg base height similar congruent
parallel perpendicular inscribed circumscribed degrees units find value given figure shown round nearest
tenth hundredth solve equation express simplest form sine cosine theorem pythagorean ratio proportion
scale factor volume surface cylinder cone sphere prism""".split()
_CHAT_WORDS = """the a an of to in is are be we you it that this with for from as on by so then therefore
thus because answer question image look first second next finally let me think step check compute result
final correct wrong user assistant system tool call response function name arguments content text type
please here there which what how why when where can will should would could use using used try again
observation feedback environment""".split()
_LATEX = (
    r"\frac", r"\sqrt", r"\boxed", r"\angle", r"\triangle", r"\pi", r"\cdot", r"\times", r"\circ",
    r"\left(", r"\right)", r"\overline", r"\sin", r"\cos", r"\tan", r"\approx", r"\le", r"\ge",
)  # fmt: skip
_VOWELS = "aeiou"
_CONSONANTS = "bcdfghjklmnprstvwz"


def tiny_training_corpus(seed: int = 0, num_lines: int = 3000) -> list[str]:
    """Deterministic generated text (about 190 kB) for training the tiny BPE.

    Pseudo-words built from syllables give the trainer enough distinct pairs to
    reach a 1k vocabulary; the rest mirrors what tests encode.
    """
    rng = random.Random(seed)
    pseudo = [
        "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(rng.randint(2, 4))) for _ in range(300)
    ]
    words = _GEOMETRY_WORDS + _CHAT_WORDS + pseudo
    letters = "ABCDEFGH"
    lines = []
    for _ in range(num_lines):
        kind = rng.randrange(5)
        if kind == 0:
            sentence = " ".join(rng.choice(words) for _ in range(rng.randint(6, 18)))
            lines.append(sentence.capitalize() + rng.choice(".?!:"))
        elif kind == 1:
            a, b, c = rng.randint(1, 99), rng.randint(1, 99), rng.randint(0, 9999)
            d = rng.randint(0, 999)
            lines.append(f"${rng.choice(_LATEX)}{{{a}}}{{{b}}} = {c}$ and {rng.choice(_LATEX)}{{{d}}}")
        elif kind == 2:
            args = {rng.choice(_CHAT_WORDS): rng.randint(-50, 5000), rng.choice(_GEOMETRY_WORDS): rng.choice(words)}
            lines.append(json.dumps({"name": rng.choice(pseudo[:20]), "arguments": args}))
        elif kind == 3:
            angle = "".join(rng.choice(letters) for _ in range(3))
            answer, degrees = rng.randint(0, 500), rng.randint(1, 179)
            lines.append(f"The answer is \\boxed{{{answer}}}. Angle {angle} = {degrees}^\\circ")
        else:
            rows = (" ".join(rng.choice(words) for _ in range(rng.randint(2, 8))) for _ in range(rng.randint(1, 4)))
            lines.append("\n".join(rows))
    return lines


def _qwen2_style_backend(pretokenize_regex: str = QWEN2_PRETOKENIZE_REGEX) -> Tokenizer:
    """An untrained BPE with Qwen2's normalizer, pre-tokenizer (or Qwen3.5's regex), decoder and post-processor."""
    tok = Tokenizer(
        BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False, byte_fallback=False)
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pretokenize_regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def build_tiny_backend(vocab_size: int = 1024, seed: int = 0,
                       pretokenize_regex: str = QWEN2_PRETOKENIZE_REGEX) -> Tokenizer:
    """The `tokenizers.Tokenizer` behind `build_tiny_tokenizer`; total size (added tokens included) = vocab_size.

    Like Qwen, the added tokens take the last ids, after the BPE vocabulary.
    """
    num_added = len(QWEN_SPECIAL_TOKENS) + len(QWEN_ADDED_TOKENS)
    bpe_size = vocab_size - num_added
    if bpe_size < 256 + 1:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: need the 256 byte tokens + merges + {num_added} added tokens"
        )
    tok = _qwen2_style_backend(pretokenize_regex)
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(tiny_training_corpus(seed), trainer=trainer)
    if tok.get_vocab_size() != bpe_size:
        raise ValueError(
            f"tiny BPE reached only {tok.get_vocab_size()} of {bpe_size} tokens for vocab_size={vocab_size}; "
            "the generated corpus has too few distinct pairs for a vocabulary this large"
        )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_ADDED_TOKENS])
    return tok


def build_tiny_tokenizer(
    vocab_size: int = 1024, seed: int = 0, chat_template: str = QWEN3_VL_CHAT_TEMPLATE,
    pretokenize_regex: str = QWEN2_PRETOKENIZE_REGEX,
) -> PreTrainedTokenizerFast:
    """A Qwen-style byte-level BPE tokenizer with `len(tokenizer) == vocab_size` and the Qwen3-VL chat template
    (or `chat_template`, e.g. `QWEN3_THINKING_CHAT_TEMPLATE`; the vocabulary does not depend on it).

    Deterministic: the same (vocab_size, seed) gives the same tokenizer.json in every process. Takes ~0.1 s.
    """
    return PreTrainedTokenizerFast(
        tokenizer_object=build_tiny_backend(vocab_size, seed, pretokenize_regex),
        bos_token=None,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=MODEL_MAX_LENGTH,
        chat_template=chat_template,
    )


# Per architecture (config.json model_type): patch size, mean, std and processor class of its preprocessing.
_PREPROCESSING: dict[str, tuple[int, tuple[float, ...], tuple[float, ...], str]] = {
    "qwen3_vl": (16, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), "Qwen3VLProcessor"),
    "qwen3_5": (16, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), "Qwen3VLProcessor"),  # Qwen3.5 ships Qwen3-VL's processor
    "qwen3_vl_moe": (16, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), "Qwen3VLProcessor"),
    "qwen3_5_moe": (16, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), "Qwen3VLProcessor"),  # as Qwen3.5
    "qwen2_5_vl": (14, CLIP_IMAGE_MEAN, CLIP_IMAGE_STD, "Qwen2_5_VLProcessor"),
}
TINY_ARCHS: tuple[str, ...] = tuple(_PREPROCESSING)


def tiny_image_processor_config(
    min_pixels: int = 64 * 64, max_pixels: int = 128 * 128, arch: str = "qwen3_vl"
) -> dict[str, Any]:
    """A `preprocessor_config.json` dict with `arch`'s values and a small pixel range.

    Qwen3-VL: patch 16, spatial merge 2, temporal patch 2, mean = std = 0.5, so one merged
    token covers 32x32 pixels. Qwen2.5-VL: patch 14 and CLIP mean/std (28x28 pixels per token).
    The released configs upscale small images; here `size` is min/max *pixel counts* (the Qwen2-VL
    processor's meaning of shortest_edge/longest_edge), e.g. Qwen3-VL 64x64 -> grid (1, 4, 4) -> 4 tokens.
    """
    if arch not in _PREPROCESSING:
        raise ValueError(f"arch={arch!r}: choose one of {TINY_ARCHS}")
    patch, mean, std, processor_class = _PREPROCESSING[arch]
    factor = patch * 2
    if min_pixels < factor * factor or max_pixels < min_pixels:
        raise ValueError(f"need {factor * factor} <= min_pixels <= max_pixels, got min={min_pixels}, max={max_pixels}")
    return {
        "image_mean": list(mean),
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "image_std": list(std),
        "merge_size": 2,
        "patch_size": patch,
        "processor_class": processor_class,
        "size": {"longest_edge": int(max_pixels), "shortest_edge": int(min_pixels)},
        "temporal_patch_size": 2,
    }


def tiny_video_processor_config(
    min_pixels: int = 64 * 64, max_pixels: int = 128 * 128, arch: str = "qwen3_vl"
) -> dict[str, Any]:
    """A `video_preprocessor_config.json` dict with `arch`'s values (as the released checkpoints ship it beside
    `preprocessor_config.json`): Qwen3VLVideoProcessor for the Qwen3 families (2 frames per second, whole-clip
    sizing), Qwen2VLVideoProcessor for Qwen2.5-VL (every frame). `size` bounds the pixels of a whole clip for the
    former and of one frame for the latter, as in transformers. The former's cap is two frames' worth of the pictures'
    cap: a clip keeps at least one temporal patch (2 frames), so no clip frame outgrows a picture, and the trainer's
    vision attention bound (`job.trainer.frame_patch_cap`) stays the pictures'."""
    image = tiny_image_processor_config(min_pixels, max_pixels, arch)
    qwen3 = image["processor_class"] == "Qwen3VLProcessor"
    out = {key: image[key] for key in ("image_mean", "image_std", "merge_size", "patch_size", "processor_class",
                                       "temporal_patch_size")}
    out.update(video_processor_type="Qwen3VLVideoProcessor" if qwen3 else "Qwen2VLVideoProcessor",
               size={"longest_edge": int(max_pixels) * (image["temporal_patch_size"] if qwen3 else 1),
                     "shortest_edge": int(min_pixels)},
               do_sample_frames=qwen3, min_frames=4, max_frames=768)
    if qwen3:
        out["fps"] = 2
    return out


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def save_tiny_processing(
    out_dir: str | Path,
    tokenizer: PreTrainedTokenizerFast | None = None,
    *,
    vocab_size: int = 1024,
    seed: int = 0,
    min_pixels: int = 64 * 64,
    max_pixels: int = 128 * 128,
    arch: str = "qwen3_vl",
) -> Path:
    """Write tokenizer.json, tokenizer_config.json, chat_template.jinja, preprocessor_config.json and
    video_preprocessor_config.json to out_dir (the preprocessing of `arch`, a `TINY_ARCHS` model_type).

    The layout matches a released Qwen3-VL checkpoint (tokenizer_class Qwen2Tokenizer, image
    processor type Qwen2VLImageProcessorFast), so loaders exercise the real code path.
    Builds the tokenizer from (vocab_size, seed) unless one is given. Returns out_dir.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer if tokenizer is not None else build_tiny_tokenizer(vocab_size, seed)
    tok.save_pretrained(str(out))
    # transformers records the in-memory class (TokenizersBackend); a Qwen checkpoint names Qwen2Tokenizer (Qwen3.5:
    # Qwen3_5Tokenizer), which AutoTokenizer rebuilds with the same pipeline as ours.
    config_path = out / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text(encoding="utf-8"))
    tok_config["tokenizer_class"] = TINY_TOKENIZER_CLASS.get(arch, "Qwen2Tokenizer")
    tok_config["add_prefix_space"] = False
    tok_config["split_special_tokens"] = False
    _write_json(config_path, tok_config)
    _write_json(out / "preprocessor_config.json", tiny_image_processor_config(min_pixels, max_pixels, arch))
    _write_json(out / "video_preprocessor_config.json", tiny_video_processor_config(min_pixels, max_pixels, arch))
    return out


def _token_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    ids = tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"tokenizer has no single id for {token!r} (encodes to {ids})")
    return ids[0]


def _merge_overrides(config: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Top-level keys replace; `text_config` / `vision_config` dicts are merged key by key."""
    out = copy.deepcopy(config)
    for key, value in overrides.items():
        if key in ("text_config", "vision_config") and isinstance(value, dict):
            out[key].update(copy.deepcopy(value))
        else:
            out[key] = copy.deepcopy(value)
    return out


def validate_qwen3_vl_config(config: dict[str, Any]) -> None:
    """Check the constraints transformers does not validate; raise ValueError naming the key.

    - text_config.rope_parameters.mrope_section sums to head_dim // 2 (M-RoPE splits the rotary half);
    - vision_config.out_hidden_size == text_config.hidden_size (merger output replaces token embeddings);
    - vision_config.num_position_embeddings is a perfect square (a learned 2-D grid);
    - len(deepstack_visual_indexes) <= text layers, each index < vision depth.
    """
    text, vision = config["text_config"], config["vision_config"]
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    section = rope.get("mrope_section")
    if section is None or sum(section) != text["head_dim"] // 2:
        raise ValueError(
            f"text_config.rope_parameters.mrope_section={section} must sum to head_dim // 2 = {text['head_dim'] // 2}"
        )
    if vision["out_hidden_size"] != text["hidden_size"]:
        raise ValueError(
            f"vision_config.out_hidden_size={vision['out_hidden_size']} must equal "
            f"text_config.hidden_size={text['hidden_size']}"
        )
    side = math.isqrt(vision["num_position_embeddings"])
    if side * side != vision["num_position_embeddings"]:
        raise ValueError(
            f"vision_config.num_position_embeddings={vision['num_position_embeddings']} is not a perfect square"
        )
    deepstack = list(vision["deepstack_visual_indexes"])
    if len(deepstack) > text["num_hidden_layers"]:
        raise ValueError(
            f"vision_config.deepstack_visual_indexes={deepstack} has more entries than "
            f"text_config.num_hidden_layers={text['num_hidden_layers']}"
        )
    if any(not 0 <= i < vision["depth"] for i in deepstack):
        raise ValueError(
            f"vision_config.deepstack_visual_indexes={deepstack} must index blocks < depth={vision['depth']}"
        )
    if text["num_attention_heads"] % text["num_key_value_heads"]:
        raise ValueError(
            f"text_config.num_attention_heads={text['num_attention_heads']} is not a multiple of "
            f"num_key_value_heads={text['num_key_value_heads']}"
        )


def tiny_qwen3_vl_hf_config(tokenizer: PreTrainedTokenizerFast, **overrides: Any) -> dict[str, Any]:
    """A transformers-5 `Qwen3VLConfig` dict for a ~350k-parameter random Qwen3-VL matching `tokenizer`.

    Text: 2 layers, hidden 64, 4 heads, 2 kv heads, head_dim 16, interleaved M-RoPE [4, 2, 2].
    Vision: depth 2, hidden 32, 2 heads, patch 16, out_hidden 64, 8x8 position grid, deepstack [0, 1].
    Token ids (image/video pads, vision start/end, bos/eos/pad) and vocab_size come from the
    tokenizer, looked up by token string. Embeddings are tied, as in Qwen3-VL-2B.
    `overrides` replace top-level keys; `text_config=`/`vision_config=` dicts merge into the defaults.
    """
    endoftext, im_end = _token_id(tokenizer, PAD_TOKEN), _token_id(tokenizer, EOS_TOKEN)
    config: dict[str, Any] = {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "model_type": "qwen3_vl",
        "image_token_id": _token_id(tokenizer, "<|image_pad|>"),
        "video_token_id": _token_id(tokenizer, "<|video_pad|>"),
        "vision_start_token_id": _token_id(tokenizer, "<|vision_start|>"),
        "vision_end_token_id": _token_id(tokenizer, "<|vision_end|>"),
        "tie_word_embeddings": True,
        "dtype": "float32",
        "text_config": {
            "model_type": "qwen3_vl_text",
            "vocab_size": len(tokenizer),
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "hidden_act": "silu",
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5000000.0,
                "mrope_section": [4, 2, 2],
                "mrope_interleaved": True,
            },
            "bos_token_id": endoftext,
            "eos_token_id": im_end,
            "pad_token_id": endoftext,
            "tie_word_embeddings": True,
            "use_cache": True,
            "dtype": "float32",
        },
        "vision_config": {
            "model_type": "qwen3_vl_vision",
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "hidden_act": "gelu_pytorch_tanh",
            "in_channels": 3,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": 64,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0, 1],
            "initializer_range": 0.02,
        },
    }
    config = _merge_overrides(config, overrides)
    if config["text_config"]["vocab_size"] < len(tokenizer):
        raise ValueError(
            f"text_config.vocab_size={config['text_config']['vocab_size']} is smaller than "
            f"the tokenizer ({len(tokenizer)})"
        )
    validate_qwen3_vl_config(config)
    return config


def tiny_qwen2_5_vl_hf_config(tokenizer: PreTrainedTokenizerFast, **overrides: Any) -> dict[str, Any]:
    """A transformers-5 `Qwen2_5_VLConfig` dict for a small random Qwen2.5-VL matching `tokenizer`.

    Text: as the tiny Qwen3-VL (2 layers, hidden 64, 4 heads, 2 kv heads, head_dim 16) with Qwen2's q/k/v
    biases and contiguous M-RoPE sections [2, 3, 3] (Qwen2.5-VL's 16:24:24 split of the rotary half).
    Vision: depth 2, hidden 32, 2 heads, patch 14, window 56 pixels (2 x 2 merged tokens, so a 112-pixel
    image spans 4 windows), full attention in block 1, gated MLP 48. Tied embeddings, as Qwen2.5-VL-3B.
    `overrides` as in `tiny_qwen3_vl_hf_config`.
    """
    base = tiny_qwen3_vl_hf_config(tokenizer)
    text = {k: v for k, v in base["text_config"].items() if k not in ("head_dim", "attention_bias")}
    text.update(model_type="qwen2_5_vl_text", rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                                                 "mrope_section": [2, 3, 3]})
    config: dict[str, Any] = dict(
        base,
        architectures=["Qwen2_5_VLForConditionalGeneration"],
        model_type="qwen2_5_vl",
        text_config=text,
        vision_config={
            "model_type": "qwen2_5_vl_vision",
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_heads": 2,
            "hidden_act": "silu",
            "in_channels": 3,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 56,
            "fullatt_block_indexes": [1],
            "tokens_per_second": 2,
            "out_hidden_size": 64,
            "initializer_range": 0.02,
        },
    )
    config = _merge_overrides(config, overrides)
    text = config["text_config"]
    heads = text["num_attention_heads"]
    if sum(text["rope_parameters"]["mrope_section"]) != text["hidden_size"] // heads // 2:
        raise ValueError("text_config mrope_section must sum to hidden_size // num_attention_heads // 2")
    if config["vision_config"]["out_hidden_size"] != text["hidden_size"]:
        raise ValueError("vision_config.out_hidden_size must equal text_config.hidden_size")
    return config


def tiny_qwen3_5_hf_config(tokenizer: PreTrainedTokenizerFast, **overrides: Any) -> dict[str, Any]:
    """A transformers-5 `Qwen3_5Config` dict for a small random Qwen3.5 (dense) matching `tokenizer`.

    Text: 4 layers in Qwen3.5's 3:1 pattern (3 Gated DeltaNet, then 1 gated full attention), hidden 64, 4 heads of
    32 (vLLM's smallest CPU head size), 2 kv heads, partial rotary 0.25 (8 of 32 dims) with interleaved M-RoPE
    [2, 1, 1]; linear layers with 2 key heads of 16 and 4 value heads of 16, conv kernel 4. Vision: Qwen3-VL's
    tower as in the tiny Qwen3-VL, without deepstack. Untied embeddings, as the released Qwen3.5 checkpoints.
    `overrides` as in `tiny_qwen3_vl_hf_config`.
    """
    base = tiny_qwen3_vl_hf_config(tokenizer)
    text = dict(base["text_config"], model_type="qwen3_5_text", num_hidden_layers=4, head_dim=32,
                layer_types=["linear_attention"] * 3 + ["full_attention"], linear_conv_kernel_dim=4,
                linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "mrope_section": [2, 1, 1],
                                 "mrope_interleaved": True, "partial_rotary_factor": 0.25})
    vision = {k: v for k, v in base["vision_config"].items() if k != "deepstack_visual_indexes"}
    config: dict[str, Any] = dict(base, architectures=["Qwen3_5ForConditionalGeneration"], model_type="qwen3_5",
                                  tie_word_embeddings=False, text_config=text,
                                  vision_config=dict(vision, model_type="qwen3_5_vision"))
    return _merge_overrides(config, overrides)


def tiny_qwen3_vl_moe_hf_config(tokenizer: PreTrainedTokenizerFast, **overrides: Any) -> dict[str, Any]:
    """A transformers-5 `Qwen3VLMoeConfig` dict for a small random Qwen3-VL-MoE matching `tokenizer`.

    Text: the tiny Qwen3-VL's decoder (hidden 64, 4 heads, 2 kv heads, head_dim 16, M-RoPE [4, 2, 2]) with 2
    layers: layer 0 a routed MoE block of 4 experts of width 48, top-2 (renormalised), and layer 1 dense (width 128,
    via `mlp_only_layers`), so both MLP kinds are exercised. Vision: the tiny Qwen3-VL's tower with deepstack [0, 1].
    Untied embeddings, as the released Qwen3-VL-30B-A3B. `overrides` as in `tiny_qwen3_vl_hf_config`.
    """
    base = tiny_qwen3_vl_hf_config(tokenizer)
    text = dict(base["text_config"], model_type="qwen3_vl_moe_text", num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[1], router_aux_loss_coef=0.001,
                tie_word_embeddings=False)
    config: dict[str, Any] = dict(base, architectures=["Qwen3VLMoeForConditionalGeneration"], model_type="qwen3_vl_moe",
                                  tie_word_embeddings=False, text_config=text,
                                  vision_config=dict(base["vision_config"], model_type="qwen3_vl_moe_vision"))
    config = _merge_overrides(config, overrides)
    validate_qwen3_vl_config(config)
    return config


def tiny_qwen3_5_moe_hf_config(tokenizer: PreTrainedTokenizerFast, **overrides: Any) -> dict[str, Any]:
    """A transformers-5 `Qwen3_5MoeConfig` dict for a small random Qwen3.5-MoE matching `tokenizer`.

    The tiny Qwen3.5's hybrid stack (3 Gated DeltaNet layers, then 1 gated full attention) whose every MLP is 4
    routed experts of width 32, top-2 (renormalised), plus a gated shared expert of width 64; no dense
    `intermediate_size`, as the released configs. `overrides` as in `tiny_qwen3_vl_hf_config`.
    """
    base = tiny_qwen3_5_hf_config(tokenizer)
    text = {k: v for k, v in base["text_config"].items() if k != "intermediate_size"}
    text.update(model_type="qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=64, router_aux_loss_coef=0.001)
    config: dict[str, Any] = dict(base, architectures=["Qwen3_5MoeForConditionalGeneration"], model_type="qwen3_5_moe",
                                  text_config=text, vision_config=dict(base["vision_config"], model_type="qwen3_5_moe_vision"))
    return _merge_overrides(config, overrides)


# Per architecture (config.json model_type): the chat template, config builder and tokenizer class of its tiny model.
TINY_CHAT_TEMPLATES: dict[str, str] = {"qwen3_vl": QWEN3_VL_CHAT_TEMPLATE, "qwen2_5_vl": QWEN2_5_VL_CHAT_TEMPLATE,
                                       "qwen3_5": QWEN3_5_CHAT_TEMPLATE, "qwen3_vl_moe": QWEN3_VL_CHAT_TEMPLATE,
                                       "qwen3_5_moe": QWEN3_5_CHAT_TEMPLATE}
TINY_HF_CONFIGS = {"qwen3_vl": tiny_qwen3_vl_hf_config, "qwen2_5_vl": tiny_qwen2_5_vl_hf_config,
                   "qwen3_5": tiny_qwen3_5_hf_config, "qwen3_vl_moe": tiny_qwen3_vl_moe_hf_config,
                   "qwen3_5_moe": tiny_qwen3_5_moe_hf_config}
TINY_PRETOKENIZE_REGEX = {"qwen3_5": QWEN3_5_PRETOKENIZE_REGEX, "qwen3_5_moe": QWEN3_5_PRETOKENIZE_REGEX}  # others: Qwen2's
TINY_TOKENIZER_CLASS = {"qwen3_5": "Qwen3_5Tokenizer", "qwen3_5_moe": "Qwen3_5Tokenizer"}  # the others: Qwen2Tokenizer
