"""LoRA on the wire: SGLang's `/load_lora_adapter` / `/unload_lora_adapter` and `lora_path` per request, vLLM's
`/v1/load_lora_adapter` / `/v1/unload_lora_adapter` and the adapter named as the request's `model`."""

from __future__ import annotations

import socket

import pytest
from aiohttp import web

from rollout.client import EngineResponseError, SGLangClient
from rollout.vllm_client import VLLMClient


class Recorder:
    """A server that records every POST and answers each adapter route as `answers` says (default success)."""

    def __init__(self, answers: dict[str, dict] | None = None):
        self.posts: list[tuple[str, dict]] = []
        self.answers = answers or {}

    async def handle(self, request: web.Request) -> web.Response:
        self.posts.append((request.path, await request.json()))
        return web.json_response(self.answers.get(request.path, {"success": True, "message": "ok"}))

    async def __aenter__(self) -> str:
        app = web.Application()
        app.router.add_route("POST", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(self.runner, sock).start()
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()


@pytest.mark.parametrize("cls, load, unload", [(SGLangClient, "/load_lora_adapter", "/unload_lora_adapter"),
                                               (VLLMClient, "/v1/load_lora_adapter", "/v1/unload_lora_adapter")])
async def test_adapters_load_on_every_worker_and_every_request_selects_the_loaded_one(cls, load, unload):
    rec_a, rec_b = Recorder(), Recorder()
    async with rec_a as url_a, rec_b as url_b:
        async with cls(url_a, worker_urls=[url_a, url_b]) as client:
            assert "lora_path" not in client._generate_body([1, 2], None, {"max_new_tokens": 4}, True, "r0")
            await client.load_lora_adapter("policy_v3", "/runs/x/lora_v000003")
            body = client._generate_body([1, 2], None, {"max_new_tokens": 4}, True, "r1")
            await client.unload_lora_adapter("policy_v3")
            after = client._generate_body([1, 2], None, {"max_new_tokens": 4}, True, "r2")
    for rec in (rec_a, rec_b):
        assert rec.posts == [(load, {"lora_name": "policy_v3", "lora_path": "/runs/x/lora_v000003"}),
                             (unload, {"lora_name": "policy_v3"})]
    if cls is SGLangClient:
        assert body["lora_path"] == "policy_v3" and "lora_path" not in after
    else:
        assert body["model"] == "policy_v3" and "model" not in after


async def test_a_refused_adapter_is_an_error_naming_the_route_and_selects_nothing():
    rec = Recorder({"/load_lora_adapter": {"success": False, "message": "adapter rank 64 > max_lora_rank 16"}})
    async with rec as url:
        async with SGLangClient(url) as client:
            with pytest.raises(EngineResponseError, match="load_lora_adapter.*max_lora_rank"):
                await client.load_lora_adapter("policy_v1", "/a")
            assert client.lora_name is None
