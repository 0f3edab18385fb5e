"""LoRA on the wire, end to end through the weight syncer: each version is a PEFT adapter directory that SGLang loads
with `/load_lora_adapter` (and selects per request by `lora_path`) and vLLM with `/v1/load_lora_adapter` (selected
by the request's `model`); the worker's weights are labelled with the version (`/update_weight_version`), which the
syncer's check reads back as for a full sync; the previous adapter is unloaded. The fake engines answer with the
shapes and statuses of SGLang's `http_server.py` (LoRAUpdateOutput: success, error_message, loaded_adapters; 400 on a
refusal) and vLLM's `serve/lora/api_router.py` (200 with a text body; 400/404 with an ErrorResponse)."""

from __future__ import annotations

import socket

import jax
import numpy as np
import pytest
from _lora_adapters import StandInPolicy, policy_with, random_adapters
from aiohttp import web
from flax import nnx

from jaxrl_vlm.lora.adapters import PolicyAdapters, adapter_nbytes, lora_setup
from jaxrl_vlm.lora.export import load_peft_adapter
from jaxrl_vlm.lora.options import LoraOptions
from jaxrl_vlm.lora.serving import engine_serves, sglang_lora_args, vllm_lora_args
from jaxrl_vlm.models.hf_io import abstract_model
from jaxrl_vlm.tiny import tiny_model_config
from jaxrl_vlm.weight_sync import WeightSyncer, WeightSyncFailed, adapter_name, serves_adapters
from rollout.client import SGLangClient
from rollout.vllm_client import VLLMClient


class FakeLoraEngine:
    """One SGLang or vLLM worker: the routes an adapter sync uses, with the engine's own answer shapes. Records every
    POST; `refuse` makes the next load fail as the engine refuses one (bad rank, bad path)."""

    def __init__(self, api: str):
        self.api = api
        self.posts: list[tuple[str, dict]] = []
        self.loaded: dict[str, str] = {}
        self.version = "default"
        self.refuse: str | None = None

    def _ok(self, name: str, verb: str) -> web.Response:
        if self.api == "sglang":
            return web.json_response({"success": True, "error_message": None, "loaded_adapters": dict(self.loaded)})
        return web.Response(text=f"Success: LoRA adapter '{name}' {verb} successfully.")

    def _refused(self, message: str, status: int) -> web.Response:
        if self.api == "sglang":
            return web.json_response({"success": False, "error_message": message,
                                      "loaded_adapters": dict(self.loaded)}, status=400)
        return web.json_response({"error": {"message": message, "type": "BadRequestError", "param": None,
                                             "code": status}}, status=status)

    async def post(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        self.posts.append((request.path, body))
        path = request.path.removeprefix("/v1") if request.path.endswith("lora_adapter") else request.path
        if path == "/load_lora_adapter":
            name = body["lora_name"]
            if self.refuse is not None:
                why, self.refuse = self.refuse, None
                return self._refused(why, 400)
            if name in self.loaded:
                return self._refused(f"The lora adapter '{name}' has already been loaded.", 400)
            self.loaded[name] = body["lora_path"]
            return self._ok(name, "added")
        if path == "/unload_lora_adapter":
            name = body["lora_name"]
            if name not in self.loaded:
                return self._refused(f"The lora adapter '{name}' cannot be found.", 404)
            del self.loaded[name]
            return self._ok(name, "removed")
        if path == "/update_weight_version":
            self.version = body["new_version"]
            return web.json_response({"success": True, "new_version": self.version})
        if path in ("/flush_cache", "/reset_prefix_cache"):
            return web.json_response({"success": True}) if self.api == "vllm" else web.Response(text="flushed")
        return web.json_response({"success": True})  # pause / continue (SGLang), pause / resume (vLLM)

    async def get(self, request: web.Request) -> web.Response:
        if request.path == "/model_info":  # SGLang
            return web.json_response({"model_path": "base", "is_generation": True, "weight_version": self.version})
        if request.path == "/weight_info":  # vLLM
            return web.json_response({"weight_version": self.version})
        if request.path == "/v1/models":  # vLLM lists the base and every loaded adapter
            cards = [{"id": "base", "root": "base"}] + [{"id": n, "root": p, "parent": "base"} for n, p in self.loaded.items()]
            return web.json_response({"object": "list", "data": cards})
        return web.json_response({})

    async def __aenter__(self) -> str:
        app = web.Application()
        app.router.add_route("POST", "/{tail:.*}", self.post)
        app.router.add_route("GET", "/{tail:.*}", self.get)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(self.runner, sock).start()
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()


@pytest.fixture(scope="module")
def setup_and_params():
    model = abstract_model(tiny_model_config())
    params = nnx.state(model, nnx.Param)
    return lora_setup(model.cfg, params, LoraOptions(lora_rank=4, lora_alpha=8.0)), params


def _version(setup, seed: int) -> tuple[StandInPolicy, list]:
    adapters = random_adapters(setup, seed)
    return policy_with(setup, adapters), adapters


@pytest.mark.parametrize("api", ["sglang", "vllm"])
async def test_each_version_loads_as_its_own_adapter_on_every_worker_and_requests_select_it(api, setup_and_params,
                                                                                           tmp_path):
    setup, params = setup_and_params
    cls, prefix = (SGLangClient, "") if api == "sglang" else (VLLMClient, "/v1")
    select = "lora_path" if api == "sglang" else "model"
    a, b = FakeLoraEngine(api), FakeLoraEngine(api)
    async with a as url_a, b as url_b:
        async with cls(url_a, worker_urls=[url_a, url_b]) as client:
            syncer = WeightSyncer(client, tmp_path / "weights", dtype=np.float32, retries=0, flush_poll_s=0.01)
            model1, adapters1 = _version(setup, 1)
            r1 = await syncer.push(model1, 1)
            model2, adapters2 = _version(setup, 2)
            r2 = await syncer.push(model2, 2)
            body = client._with_adapter(client._generate_body([1, 2], None, {"max_new_tokens": 4}, True, "r"))
            assert await client.get_weight_versions() == {url_a: "2", url_b: "2"}

    # Only the adapters moved: a PEFT directory per version, 5x and more below the model's bytes (fp32 both).
    assert r1.adapters_only and r2.adapters_only and not r2.in_memory
    model_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))
    assert r2.metrics()["sync/gbytes"] * 1e9 == r2.bytes_written >= adapter_nbytes(adapters2, np.float32)
    assert r2.metrics()["sync/adapters_only"] == 1.0 and 5 * r2.bytes_written < model_bytes
    assert r2.path == tmp_path / "weights" / "lora_v000002" and not r1.path.exists()  # the old version is deleted
    for got, put in zip(load_peft_adapter(r2.path, setup), adapters2):
        assert all(np.array_equal(got[k], put[k]) for k in ("lora_A", "lora_B"))

    for engine in (a, b):
        lora_posts = [(p, body) for p, body in engine.posts if "lora" in p or "version" in p]
        assert lora_posts == [
            (f"{prefix}/load_lora_adapter", {"lora_name": "policy_v000001", "lora_path": str(r1.path)}),
            ("/update_weight_version", {"new_version": "1"}),
            (f"{prefix}/load_lora_adapter", {"lora_name": "policy_v000002", "lora_path": str(r2.path)}),
            ("/update_weight_version", {"new_version": "2"}),
            (f"{prefix}/unload_lora_adapter", {"lora_name": "policy_v000001"}),
        ]
        # Each load happens while the worker is paused, as a full weight update does.
        paths = [p for p, _ in engine.posts]
        load = paths.index(f"{prefix}/load_lora_adapter")
        assert paths[load - 2] in ("/pause_generation", "/pause") and paths[load + 2] in ("/continue_generation", "/resume")
        assert engine.loaded == {"policy_v000002": str(r2.path)}
    assert body[select] == adapter_name(2) == "policy_v000002"


async def test_a_refused_adapter_fails_the_sync_naming_the_reason_and_keeps_the_loaded_one(setup_and_params, tmp_path):
    setup, _ = setup_and_params
    a, b = FakeLoraEngine("sglang"), FakeLoraEngine("sglang")
    async with a as url_a, b as url_b:
        async with SGLangClient(url_a, worker_urls=[url_a, url_b]) as client:
            syncer = WeightSyncer(client, tmp_path / "weights", dtype=np.float32, retries=0, flush_poll_s=0.01)
            await syncer.push(_version(setup, 1)[0], 1)
            b.refuse = "LoRA adapter rank 4 exceeds max_lora_rank 2"
            with pytest.raises(WeightSyncFailed, match="max_lora_rank"):
                await syncer.push(_version(setup, 2)[0], 2)
            # Requests keep the adapter every worker holds; the half-loaded one is gone, so a retry can load it.
            assert client.lora_name == "policy_v000001"
            assert a.loaded.keys() == b.loaded.keys() == {"policy_v000001"}
            retried = await syncer.push(_version(setup, 2)[0], 2)
            assert retried.adapters_only and client.lora_name == "policy_v000002"


def test_adapters_the_engines_cannot_serve_are_merged_and_launched_servers_get_lora_flags(setup_and_params):
    setup, params = setup_and_params
    cfg = abstract_model(tiny_model_config()).cfg
    norm = lora_setup(cfg, params, LoraOptions(lora_rank=4, lora_modules_to_save=["model.language_model.norm"]))
    vision = lora_setup(cfg, params, LoraOptions(lora_rank=4, lora_vision=True))
    assert serves_adapters(PolicyAdapters(setup, []))
    assert not serves_adapters(PolicyAdapters(norm, [])) and not serves_adapters(PolicyAdapters(vision, []))
    # Qwen3.5: adapters on its linear-attention layers are merged; on its full-attention and MLP layers alone, served.
    hybrid = abstract_model(tiny_model_config(arch="qwen3_5"))
    hybrid_params = nnx.state(hybrid, nnx.Param)
    every = lora_setup(hybrid.cfg, hybrid_params, LoraOptions(lora_rank=4))
    assert any(".linear_attn." in s.module for s in every.sites) and not serves_adapters(PolicyAdapters(every, []))
    served = lora_setup(hybrid.cfg, hybrid_params, LoraOptions(lora_rank=4, lora_target_modules=["q_proj", "down_proj"]))
    assert served.sites and serves_adapters(PolicyAdapters(served, []))
    options = LoraOptions(lora_rank=4)
    assert engine_serves(options) and not engine_serves(LoraOptions(lora_rank=4, lora_sync="merged"))
    assert sglang_lora_args(options, []) == ["--enable-lora", "--max-lora-rank", "4", "--lora-target-modules", "all"]
    assert sglang_lora_args(LoraOptions(lora_rank=4, lora_target_modules=["self_attn.q_proj", "v_proj"]),
                            ["--max-lora-rank=8"]) == ["--enable-lora", "--lora-target-modules", "q_proj", "v_proj"]
    assert vllm_lora_args(options, []) == ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"]
    assert sglang_lora_args(LoraOptions(lora_rank=0), []) == [] == vllm_lora_args(LoraOptions(lora_rank=4, lora_vision=True), [])
