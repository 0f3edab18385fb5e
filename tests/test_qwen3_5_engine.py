"""Qwen3.5 in the embedded engine: the hybrid cache (KV pages for the full-attention layers, conv and delta-rule state
for the linear ones) against transformers' PyTorch Qwen3.5 and the trainer's full forward.

- a multi-turn conversation with a new picture in the observation decodes greedily as transformers does, and its
  second turn continues from the state the first left (`cached_tokens` is exactly the first turn's fed tokens);
- a GRPO group of 8 prefills its image prompt once: the first sample keeps the state before the last prompt token,
  the other 7 copy it and compute that one token; their log-probs at T = 0.7 equal the trainer's;
- tensor-parallel (tp 2) and tp 2 x dp 2 engines give the one-device engine's tokens, log-probs and `cached_tokens`;
- weights updated in memory (no flush) serve what a new engine on those weights serves, and no prefix or state
  snapshot of the old weights is reused;
- `make-tiny --arch qwen3_5` writes a checkpoint that transformers loads with our logits, with Qwen3.5's tokenizer
  class, pre-tokenizer and thinking template.
"""

from __future__ import annotations

import asyncio
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from _forward import full_logits
from _hf_tiny import spread_weights
from test_engine import hf_generate, our_logits_logprobs
from test_engine_prefix_cache import Conversation, client, image_item, text_item

from jaxrl_vlm.engine import EmbeddedEngine, EngineOptions
from jaxrl_vlm.tiny import tiny_hf_config
from jaxrl_vlm.tiny_assets import QWEN3_5_PRETOKENIZE_REGEX, save_tiny_processing
from rollout.encoding import ChatEncoder

TOL = 1e-4


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(engine, transformers model, encoder): a tiny random Qwen3.5 built by transformers from the tiny config
    (Qwen3.5 tokenizer and template), served by the embedded engine with room for a group of 8."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    config, tokenizer = tiny_hf_config(arch="qwen3_5")
    torch.manual_seed(0)
    hf = Qwen3_5ForConditionalGeneration(Qwen3_5Config(**config)).float().eval()
    spread_weights(hf, 1, embed_std=0.1)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():  # decays that keep the recurrent state over many tokens (a wrong hand-over shows)
        for key, p in hf.named_parameters():
            if key.endswith("A_log"):
                p.copy_(-1.0 + 0.5 * torch.randn(p.shape, generator=gen))
    text = config["text_config"]
    hf.generation_config.eos_token_id = [text["eos_token_id"], text["pad_token_id"]]
    out = tmp_path_factory.mktemp("q35_engine")
    hf.save_pretrained(str(out))
    save_tiny_processing(out, tokenizer, arch="qwen3_5")
    options = EngineOptions(max_batch=8, max_seq_len=256, min_prefill_bucket=64, min_kv_bucket=256,
                            decode_batch_sizes=(8,), min_patch_bucket=64)
    eng = EmbeddedEngine(str(out), config=options)
    eng.start()
    # The engine never samples Qwen-VL's vision special tokens; transformers' greedy reference may not either.
    hf.generation_config.suppress_tokens = list(eng.engine.runner.banned_ids)
    yield eng, hf, ChatEncoder(eng.engine.tokenizer, eng.engine.image_processor)
    eng.stop()


def _mm(*segments) -> dict[str, np.ndarray]:
    return {k: np.concatenate([s.mm_inputs[k] for s in segments]) for k in ("pixel_values", "image_grid_thw")}


async def test_multi_turn_images_decode_as_transformers_and_continue_from_the_stored_state(served, make_test_image):
    engine, hf, encoder = served
    pad = encoder.vision.image_pad
    params = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
    content = [image_item(make_test_image(3, (96, 64))), text_item("Which color is the square?")]
    seg = encoder.encode_prompt([{"role": "user", "content": content}])
    obs = encoder.encode_observation([{"role": "user", "content": [
        image_item(make_test_image(4, (64, 96))), text_item("And now?")]}], model_ended_turn=False)
    async with client(engine) as c:
        await c.flush_cache()
        first = await c.generate(seg.wire_ids, image_data=seg.image_data, sampling_params=params)
        before = engine.stats.prefilled_tokens
        second = await c.generate(seg.wire_ids + first.output_ids + obs.wire_ids, image_data=seg.image_data + obs.image_data,
                                  sampling_params=params)
    expected = hf_generate(hf, seg.train_ids, 6, seg.mm_inputs, pad)
    assert len(expected) == 6 and len(set(expected)) > 1, "degenerate reference: the test would not see a wrong token"
    assert first.output_ids == expected
    train = seg.train_ids + first.output_ids + obs.train_ids
    assert second.output_ids == hf_generate(hf, train, 6, _mm(seg, obs), pad)[:6]
    # The second turn continues from the state after everything the first fed (its prompt and outputs but the last).
    fed = first.prompt_tokens + len(first.output_ids) - 1
    assert second.cached_tokens == fed
    assert engine.stats.prefilled_tokens - before == second.prompt_tokens - fed


async def test_a_group_of_8_prefills_its_image_prompt_once_and_matches_the_trainer_at_t_0_7(served, make_test_image):
    engine, _, encoder = served
    conv = Conversation(encoder, [text_item("Look at the picture."), image_item(make_test_image(7, (96, 96))),
                                  text_item("Name the color.")])
    n, temperature = 8, 0.7
    params = [{"temperature": temperature, "max_new_tokens": 8, "ignore_eos": True, "sampling_seed": 300 + i}
              for i in range(n)]
    async with client(engine) as c:
        await c.flush_cache()
        before = (engine.stats.prefilled_tokens, engine.stats.encoded_images)
        results = await asyncio.gather(*(c.generate(conv.ids, image_data=conv.images, sampling_params=p) for p in params))
    prompt = results[0].prompt_tokens
    assert sorted(r.cached_tokens for r in results) == [0] + [prompt - 1] * (n - 1)
    assert engine.stats.prefilled_tokens - before[0] == prompt + (n - 1)
    assert engine.stats.encoded_images - before[1] == 1
    assert len({tuple(r.output_ids) for r in results}) > 1
    seg = encoder.encode_prompt([{"role": "user", "content": [
        text_item("Look at the picture."), image_item(make_test_image(7, (96, 96))), text_item("Name the color.")]}])
    for r in results:  # each sample's state came from the snapshot: its log-probs are the full forward's
        trainer = our_logits_logprobs(engine, seg.train_ids, r.output_ids, seg.mm_inputs, temperature=temperature)
        np.testing.assert_allclose(r.output_log_probs, trainer, atol=TOL, rtol=0)


GREEDY_6 = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}


def _episode_start(encoder: ChatEncoder, make_test_image) -> Conversation:
    return Conversation(encoder, [image_item(make_test_image(3, (96, 64))), text_item("Which color is the square?")])


async def _two_turns(engine: EmbeddedEngine, encoder: ChatEncoder, make_test_image) -> list:
    """Greedy results of a two-turn episode (a picture in the prompt, a new one in the observation) from a flushed
    engine: the second turn continues from the state the first stored."""
    conv = _episode_start(encoder, make_test_image)
    async with client(engine) as c:
        await c.flush_cache()
        first = await c.generate(conv.ids, image_data=conv.images, sampling_params=GREEDY_6)
        conv.add_turn(first.output_ids, [image_item(make_test_image(4, (64, 96))), text_item("And now?")])
        second = await c.generate(conv.ids, image_data=conv.images, sampling_params=GREEDY_6)
    return [first, second]


def _assert_same_results(got: list, want: list) -> None:
    for g, w in zip(got, want, strict=True):
        assert (g.output_ids, g.cached_tokens, g.prompt_tokens) == (w.output_ids, w.cached_tokens, w.prompt_tokens)
        np.testing.assert_allclose(g.output_log_probs, w.output_log_probs, atol=2e-5, rtol=0)


@pytest.mark.parametrize("tp,dp", [(2, 2), (2, 1)])
async def test_tensor_and_data_parallel_engines_equal_the_one_device_engine(served, make_test_image, tp, dp):
    """The linear layers' heads and state split over `tensor` (2 key heads, 4 value heads: 1 and 2 per device), the
    conv and recurrent state snapshots per replica: tokens, log-probs and `cached_tokens` are the one-device engine's."""
    engine, _, encoder = served
    want = await _two_turns(engine, encoder, make_test_image)
    assert want[1].cached_tokens > 0 and len(set(want[0].output_ids + want[1].output_ids)) > 2
    # Devices 4.. (not the first n): tp 2 alone runs on dp 2's first replica's devices, whose programs it can reuse
    # from the compilation cache.
    options = dataclasses.replace(engine.config, tp_size=tp, dp_size=dp, device_ids=tuple(range(4, 4 + tp * dp)))
    with EmbeddedEngine(engine.model_dir, config=options) as sharded:
        runners = sharded.engine.runners
        assert len(runners) == dp
        layer = runners[0].cfg.text.linear_layers[0]
        kernel = runners[0].params["layers"][layer]["linear_attn"]["v_kernel_dhv"].get_value()
        assert kernel.addressable_shards[0].data.shape[1] == kernel.shape[1] // tp  # value heads split over tp
        got = await _two_turns(sharded, ChatEncoder(sharded.engine.tokenizer, sharded.engine.image_processor),
                               make_test_image)
    _assert_same_results(got, want)


async def test_in_memory_weight_update_serves_a_fresh_engine_and_no_stale_state(served, make_test_image, tmp_path):
    """New weights staged in memory and swapped in without a flush: the prefix cache and the conv / recurrent state
    snapshots of the old weights are never served (the next request prefills from 0), and every output is what a new
    engine built on those weights from disk gives, including a second turn continuing from a post-update state."""
    from flax import nnx

    from jaxrl_vlm.models import from_hf, to_hf
    from rollout.sglang_wire import IN_MEMORY_LOAD_FORMAT

    engine, _, encoder = served
    before = await _two_turns(engine, encoder, make_test_image)  # leaves both turns' prefixes and states cached
    model = from_hf(engine.model_dir)
    rng = np.random.default_rng(5)
    state = jax.tree.map(lambda x: x + jnp.asarray(rng.normal(0, 0.05, x.shape), x.dtype), nnx.state(model, nnx.Param))
    nnx.update(model, state)
    to_hf(model, tmp_path / "v1", dtype=jnp.float32, copy_from=engine.model_dir)  # fp32: the staged values exactly
    conv = _episode_start(encoder, make_test_image)
    try:
        engine.engine.stage_weights("v1", state)
        async with client(engine) as c:
            answer = await c.update_weights_from_disk("v1", "1", load_format=IN_MEMORY_LOAD_FORMAT, flush_cache=False)
            assert answer["success"], answer
            stale = await c.generate(conv.ids, image_data=conv.images, sampling_params=GREEDY_6)
        assert stale.cached_tokens == 0 and stale.weight_version == "1"
        after = await _two_turns(engine, encoder, make_test_image)
        with EmbeddedEngine(str(tmp_path / "v1"), config=engine.config) as fresh:
            want = await _two_turns(fresh, encoder, make_test_image)
        assert [r.output_ids for r in want] != [r.output_ids for r in before], "the new weights change nothing"
        _assert_same_results([stale], want[:1])
        _assert_same_results(after, want)
    finally:  # the module's engine serves the transformers reference's weights again
        async with client(engine) as c:
            assert (await c.update_weights_from_disk(engine.model_dir, "default"))["success"]


@pytest.mark.slow
def test_make_tiny_qwen3_5_loads_in_transformers_with_our_logits_and_qwen3_5_processing(tmp_path, make_test_image):
    import jax.numpy as jnp
    from transformers import Qwen3_5ForConditionalGeneration
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX

    from jaxrl_vlm.cli import main
    from jaxrl_vlm.models import build_vision_inputs, from_hf, get_rope_index
    from rollout.processing import hf_reference_processor, load_image_processor, load_tokenizer

    out = tmp_path / "q35"
    assert main(["make-tiny", str(out), "--arch", "qwen3_5", "--seed", "3"]) == 0
    assert QWEN3_5_PRETOKENIZE_REGEX == PRETOKENIZE_REGEX
    tok = load_tokenizer(out)
    built = tiny_hf_config(arch="qwen3_5")[1]
    assert type(tok).__name__ == "Qwen3_5Tokenizer"
    for text in ["naïve café", "x̂ + ŷ = 2", "<|im_start|>user\nGo<|im_end|>\n<think>\n"]:  # combining marks
        assert tok.encode(text, add_special_tokens=False) == built.encode(text, add_special_tokens=False)
    user = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True).endswith(
        "<|im_start|>assistant\n<think>\n")
    assert tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")

    processor = hf_reference_processor(tok, load_image_processor(out))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find the angle."}]},
                {"role": "assistant", "content": "<think>\nlook\n</think>\n\nIt is 42."},
                {"role": "user", "content": [{"type": "text", "text": "Now this one:"}, {"type": "image"}]}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[prompt], images=[make_test_image(1, 64), make_test_image(2, (96, 64))], return_tensors="np")
    # The reference runs in float64: transformers' own fp32 logits of this tiny model stray ~1e-4 from it (small
    # head dims magnify the round-off of its gated and l2 norms; see test_qwen3_5.py).
    hf = Qwen3_5ForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval().double()
    tensors = {k: torch.from_numpy(np.asarray(v)) for k, v in inputs.items()}
    tensors["pixel_values"] = tensors["pixel_values"].double()
    with torch.no_grad():
        ref = hf(**tensors).logits.numpy()[0]
    model = from_hf(out)
    ids, mask = np.asarray(inputs["input_ids"], np.int32), np.asarray(inputs["attention_mask"], np.int32)
    grid = np.asarray(inputs["image_grid_thw"])
    positions, _ = get_rope_index(ids, grid, mask, model.cfg)
    vision = build_vision_inputs(np.asarray(inputs["pixel_values"]), grid, ids, model.cfg, patch_bucket=64,
                                 token_valid=mask)
    logits = np.asarray(full_logits(model, jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(mask), vision))[0]
    # A load check of make-tiny's scaled init (larger activations than the parity fixture's): fp32 round-off of
    # ~1e-4 either side (transformers' fp32 strays 6e-5 from its float64 here); test_qwen3_5.py holds parity to 1e-4.
    np.testing.assert_allclose(logits, ref, atol=2 * TOL, rtol=0)
    assert ref.std() > 0.3  # the scaled init gives logits a usable spread
