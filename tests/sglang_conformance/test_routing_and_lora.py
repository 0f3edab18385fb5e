"""Routing replay (issue 31) and LoRA serving (issue 30) against SGLang 0.5.23's own code.

Routed experts: the stand-in scheduler hands each finished request an int32 [seqlen - 1, layers, top_k] tensor, as
`batch_result_processor._maybe_collect_routed_experts` does; SGLang's detokenizer encodes it
(`DetokenizerManager._b64_encode_per_request`) and its tokenizer manager puts it in `meta_info.routed_experts`. Our
client must decode exactly those ids. LoRA: the weight syncer's adapter versions go through SGLang's
`/load_lora_adapter`, `/unload_lora_adapter`, `/update_weight_version` routes, request classes and tokenizer-manager
bookkeeping (LoRARegistry, `_validate_and_resolve_lora`); the stand-in scheduler reads each PEFT directory with
SGLang's `LoRAConfig` and checks it against the server's `--max-lora-rank` / `--lora-target-modules` as
`LoRAManager.validate_new_adapter` does. The server runs with the flags our launcher passes (`conftest.server_flags`).
"""

from __future__ import annotations

import asyncio
import json
from types import ModuleType, SimpleNamespace
from typing import Any

import aiohttp
import numpy as np
import pytest
from flax import nnx

from conftest import LORA_RANK, run_in_sglang
from test_sglang_conformance import _EndlessEnv  # answers every turn with text, never done
from jaxrl_vlm.lora.adapters import PolicyAdapters, adapters_of, attach_adapters, lora_setup
from jaxrl_vlm.lora.export import save_peft_adapter
from jaxrl_vlm.lora.options import LoraOptions
from jaxrl_vlm.lora.serving import sglang_lora_args
from jaxrl_vlm.models.hf_io import abstract_model
from jaxrl_vlm.tiny import tiny_model_config
from jaxrl_vlm.weight_sync import WeightSyncer, WeightSyncFailed, adapter_name
from rollout.client import EngineRequestError, SGLangClient
from rollout.encoding import ChatEncoder
from rollout.multiturn import RolloutContext, generate
from rollout.sample import Sample
from rollout.sglang_wire import FinishType, decode_routed_experts, encode_routed_experts

pytestmark = pytest.mark.sglang_conformance

PARAMS = {"max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "stop_token_ids": [151645],
          "skip_special_tokens": False, "no_stop_trim": True, "spaces_between_special_tokens": False}
MOE_LAYERS, MOE_TOP_K = 3, 2  # the stand-in's MoE (_sglang_stub_server.py)


def client_for(url: str, **kw: Any) -> SGLangClient:
    return SGLangClient(url, **{"connect_timeout_s": 5.0, "control_timeout_s": 30.0, "health_timeout_s": 30.0, **kw})


async def _get(url: str, path: str) -> Any:
    async with aiohttp.ClientSession() as http:
        async with http.get(url + path) as reply:
            assert reply.status == 200, await reply.text()
            return await reply.json()


async def _post(url: str, path: str, body: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http:
        async with http.post(url + path, json=body) as reply:
            return reply.status, await reply.json(content_type=None)


def produced(seen: dict[str, Any]) -> np.ndarray:
    """The stand-in scheduler's routed-experts tensor for one request, checked for SGLang's dtype and shape."""
    routed = seen["routed_experts"]
    assert routed["dtype"] == "torch.int32" and len(routed["shape"]) == 3
    assert routed["shape"][1:] == [MOE_LAYERS, MOE_TOP_K]
    return np.asarray(routed["ids"], dtype=np.int64)


# ---------------------------------------------------------------------------------------------- routing replay


async def test_routed_experts_decode_to_the_ids_sglang_encoded(sglang_server):
    prompt = [151644, 872, 198, 3838]
    async with client_for(sglang_server.url) as client:
        result = await client.generate(prompt, sampling_params=PARAMS, rid="routed-1", return_routed_experts=True)
        plain = await client.generate(prompt, sampling_params=PARAMS, rid="routed-0")
    want = produced(await _get(sglang_server.url, "/stub/seen/routed-1"))
    got = decode_routed_experts(result.meta_info)
    # SGLang's wire format: one base64 string of the int32 bytes; every forwarded position (prompt + output - 1).
    assert isinstance(result.meta_info["routed_experts"], str)
    assert want.shape == (len(prompt) + len(result.output_ids) - 1, MOE_LAYERS, MOE_TOP_K) == (7, 3, 2)
    assert got.dtype == np.int32 and got.shape == (7, MOE_LAYERS * MOE_TOP_K)
    assert np.array_equal(got.reshape(want.shape), want) and want.max() > 255  # ids wider than a byte survive
    # The embedded engine's encoder writes SGLang's string, byte for byte.
    assert encode_routed_experts(want) == result.meta_info["routed_experts"]
    # Not asked: no key at all (SGLang's scheduler collects them only for requests that ask).
    assert "routed_experts" not in plain.meta_info and decode_routed_experts(plain.meta_info) is None


async def test_a_replayed_episode_keeps_the_last_answers_routing_for_every_position(sglang_server, tiny_tokenizer,
                                                                                   tiny_image_processor):
    """Routing replay end to end through `rollout.multiturn.generate`: each turn's request asks for routed experts,
    SGLang's answer covers the whole conversation so far, and the sample keeps the last one, a row per token but
    the last."""
    module = ModuleType("two_turn_env")
    module.build_env = lambda sample, args: _EndlessEnv()
    prompt = [{"role": "user", "content": [{"type": "text", "text": "Find x."}]}]
    # Every turn's wire prompt ends with the generation prompt; the stand-in counts up from its last id: stop at +3.
    rendered = tiny_tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    stop = tiny_tokenizer.encode(rendered, add_special_tokens=False)[-1] + 3
    async with client_for(sglang_server.url) as client:
        ctx = RolloutContext(client=client, encoder=ChatEncoder(tiny_tokenizer, tiny_image_processor),
                             env_module=module, generate_slots=asyncio.Semaphore(4))
        before = set(await _get(sglang_server.url, "/stub/seen"))
        args = SimpleNamespace(
            rollout_max_response_len=64, rollout_max_context_len=None, max_turns=2, max_env_retries_per_turn=1,
            env_step_timeout=5.0, episode_timeout=30.0, delta_check="off", rollout_temperature=1.0, rollout_top_p=1.0,
            rollout_top_k=-1, rollout_stop_token_ids=[stop], partial_rollout=False, rollout_context=ctx,
            use_rollout_routing_replay=True)
        out = await asyncio.wait_for(generate(args, Sample(prompt=prompt, label="7")), 30.0)
        rids = [r for r in await _get(sglang_server.url, "/stub/seen") if r not in before]
        seen = [await _get(sglang_server.url, f"/stub/seen/{r}") for r in rids]
    assert len(out.turns) == 2 and len(seen) == 2, (out.status, out.metadata, rids)
    first, last = (produced(s) for s in sorted(seen, key=lambda s: len(s["routed_experts"]["ids"])))
    routed = out.rollout_routed_experts
    assert routed.dtype == np.int32 and routed.shape == (len(out.tokens) - 1, MOE_LAYERS * MOE_TOP_K)
    assert np.array_equal(routed, last.reshape(routed.shape))
    assert np.array_equal(last[: len(first)], first)  # the second turn's answer repeats the first turn's positions


# ---------------------------------------------------------------------------------------------- LoRA


class _Model:
    """Stands for a merged policy model: the syncer reads only the adapters it carries."""


@pytest.fixture(scope="module")
def lora_base():
    model = abstract_model(tiny_model_config())
    return model.cfg, nnx.state(model, nnx.Param)


def _policy(lora_base, seed: int, **options: Any) -> tuple[_Model, Any]:
    cfg, params = lora_base
    setup = lora_setup(cfg, params, LoraOptions(**{"lora_rank": LORA_RANK, "lora_alpha": 8.0, **options}))
    rng = np.random.default_rng(seed)
    adapters = [{"lora_A": rng.normal(size=(setup.rank, s.in_features)).astype(np.float32),
                 "lora_B": rng.normal(size=(s.out_features, setup.rank)).astype(np.float32)} for s in setup.sites]
    return attach_adapters(_Model(), PolicyAdapters(setup, adapters)), setup


async def _reset(url: str, client: SGLangClient) -> None:
    """Leave the shared server as the other tests expect it: no adapter, weight version "default"."""
    if client.lora_name is not None:
        await client.unload_lora_adapter(client.lora_name)
    status, _ = await _post(url, "/update_weight_version", {"new_version": "default"})
    assert status == 200


async def test_each_adapter_version_loads_is_selected_by_name_and_the_old_one_unloads(sglang_server, lora_base,
                                                                                      tmp_path):
    url = sglang_server.url
    async with client_for(url) as client:
        syncer = WeightSyncer(client, tmp_path / "weights", dtype=np.float32, retries=0, flush_poll_s=0.01)
        try:
            r1 = await syncer.push(_policy(lora_base, 1)[0], 1)
            first = await client.generate([5, 6], sampling_params=PARAMS, rid="lora-1")
            r2 = await syncer.push(_policy(lora_base, 2)[0], 2)
            second = await client.generate([5, 6], sampling_params=PARAMS, rid="lora-2")
            models = await _get(url, "/v1/models")
            versions = await client.get_weight_versions()
            # A request naming the unloaded version: SGLang reloads it from its old directory (lora_ref_cache),
            # which the syncer deleted; so it is refused, never served by stale weights.
            stale_status, stale = await _post(url, "/generate", {"input_ids": [5], "lora_path": adapter_name(1),
                                                                 "sampling_params": PARAMS})
            never_status, never = await _post(url, "/generate", {"input_ids": [5], "lora_path": "nope",
                                                                 "sampling_params": PARAMS})
        finally:
            await _reset(url, client)
    seen1, seen2 = [await _get(url, f"/stub/seen/{rid}") for rid in ("lora-1", "lora-2")]
    # Each request went to the adapter the syncer had just loaded, resolved by SGLang's registry from its name.
    assert seen1["lora_path"] == adapter_name(1) and seen1["adapter_dir"] == str(r1.path) and seen1["lora_id"]
    assert seen2["lora_path"] == adapter_name(2) and seen2["adapter_dir"] == str(r2.path)
    assert first.weight_version == "1" and second.weight_version == "2" and set(versions.values()) == {"2"}
    # /v1/models lists the base and every adapter SGLang holds: only the current version is left.
    assert [m["id"] for m in models["data"][1:]] == [adapter_name(2)]
    assert stale_status == 400 and "Failed to implicitly load LoRA adapter" in json.dumps(stale)
    assert never_status == 400 and "has never been loaded" in json.dumps(never)


async def test_an_adapter_sglang_refuses_fails_the_sync_with_its_reason(sglang_server, lora_base, tmp_path):
    """Rank above the server's --max-lora-rank: SGLang's answer (400, success false, error_message) stops the sync
    naming the cause, and requests keep the adapter every worker holds."""
    url = sglang_server.url
    async with client_for(url) as client:
        syncer = WeightSyncer(client, tmp_path / "weights", dtype=np.float32, retries=0, flush_poll_s=0.01)
        try:
            await syncer.push(_policy(lora_base, 1)[0], 1)
            with pytest.raises(WeightSyncFailed, match="incompatible with the current LoRA memory pool"):
                await syncer.push(_policy(lora_base, 2, lora_rank=2 * LORA_RANK)[0], 2)
            assert client.lora_name == adapter_name(1)
            kept = await client.generate([5], sampling_params=PARAMS, rid="lora-kept")
        finally:
            await _reset(url, client)
    assert (await _get(url, "/stub/seen/lora-kept"))["lora_path"] == adapter_name(1) and kept.weight_version == "1"
    with pytest.raises(EngineRequestError, match="does not exist"):  # the reset unloaded the one adapter left
        async with client_for(url) as client:
            await client.unload_lora_adapter(adapter_name(1))


async def test_relabelling_the_version_aborts_requests_that_would_continue_on_the_old_adapter(sglang_server,
                                                                                              lora_base, tmp_path):
    """SGLang fixes a request's adapter when it is admitted (`_validate_and_resolve_lora`), so a request kept across
    an adapter switch (pause retract / in_place) would go on with the old adapter under the new version's label.
    `/update_weight_version` aborts every request unless told otherwise (`abort_all_requests` defaults to true), and
    our client leaves that default: such a request comes back aborted (partial rollout reruns it), not mislabelled."""
    url = sglang_server.url
    lora = adapters_of(_policy(lora_base, 3)[0])
    path = save_peft_adapter(lora.setup, lora.adapters, tmp_path / "policy_retract", dtype=np.float32)
    async with client_for(url) as client:
        try:
            pending = asyncio.ensure_future(client.generate([20], sampling_params={**PARAMS, "max_new_tokens": 40}))
            await asyncio.sleep(0.3)
            await client.sync_weights_from_disk(str(path), "r1", pause_mode="retract", flush_poll_s=0.05,
                                                lora_name="policy_retract")
            result = await pending
        finally:
            await _reset(url, client)
    assert result.finish_reason is FinishType.ABORT and len(result.output_ids) < 40


# ---------------------------------------------------------------------------------------------- server flags


def test_our_lora_and_routing_flags_pass_sglangs_server_argument_checks(tmp_path):
    """Every LoRA flag set our launcher produces (`sglang_lora_args`: `all` for all-linear, else the targets' last
    names) and `--enable-return-routed-experts`, through 0.5.23's argparse, resolution and `check_server_args`
    (`check_lora_server_args`: with no --lora-paths both the rank and the targets are required)."""
    cases = {
        "all-linear": sglang_lora_args(LoraOptions(lora_rank=8), []),
        "attention": sglang_lora_args(LoraOptions(lora_rank=8, lora_target_modules=["self_attn.q_proj", "v_proj"]), []),
        "every-name": sglang_lora_args(LoraOptions(lora_rank=16, lora_target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "mlp.gate_proj", "up_proj", "model.language_model.layers.0.mlp.down_proj"]),
            []),
    }
    out = run_in_sglang(
        "import argparse, json, tempfile\nfrom transformers import Qwen3VLConfig\n"
        "from sglang.srt.server_args import ServerArgs\n"
        "model = tempfile.mkdtemp()\nQwen3VLConfig(architectures=['Qwen3VLForConditionalGeneration']).save_pretrained(model)\n"
        "res = {}\n"
        f"for name, flags in {cases!r}.items():\n"
        "    p = argparse.ArgumentParser(exit_on_error=False)\n    ServerArgs.add_cli_args(p)\n"
        "    sa = ServerArgs.from_cli_args(p.parse_args(['--model-path', model, '--device', 'cpu', *flags,\n"
        "                                                '--enable-return-routed-experts']))\n"
        "    sa.resolve_once()\n    sa.check_server_args()\n"
        "    res[name] = [sa.enable_lora, sa.max_lora_rank, sorted(sa.lora_target_modules),\n"
        "                 sa.enable_return_routed_experts]\n"
        "print(json.dumps(res))\n", timeout_s=180.0)
    got = json.loads(out.strip().splitlines()[-1])
    assert got == {
        "all-linear": [True, 8, ["all"], True],
        "attention": [True, 8, ["q_proj", "v_proj"], True],
        "every-name": [True, 16, ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"], True],
    }
