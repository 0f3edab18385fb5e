"""`--engine-api-key` (SGLang's `--api-key`) for the train/eval/rollout commands: the client sends it to an external
engine, the embedded engine requires it, and it never reaches config dumps or the args env code receives."""

from __future__ import annotations

import aiohttp
import pytest

from jaxrl_vlm.config import REDACTED, ConfigError, load_config
from jaxrl_vlm.job.session import rollout_session
from rollout.client import EngineError
from rollout.fake_engine import FakeSGLangServer

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from jaxrl_vlm.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny") / "model", seed=4)


def _config(tiny, *extra: str):
    return load_config(None, ["--hf-checkpoint", str(tiny), "--rollout-interaction-env-path", "envs.letter_game",
                              "--engine-start-timeout", "5", *extra])


@pytest.mark.slow
def test_the_key_is_a_redacted_credential_kept_from_env_args(tiny):
    cfg = _config(tiny, "--engine-api-key", KEY)
    assert cfg.engine.engine_api_key == KEY
    assert cfg.to_dict()["engine"]["engine_api_key"] == REDACTED and KEY not in cfg.dump_yaml()
    args = cfg.to_namespace()
    assert not hasattr(args, "engine_api_key") and not hasattr(args, "wandb_key")
    with pytest.raises(ConfigError, match="engine_api_key must be a non-empty"):
        _config(tiny, "--engine-api-key", " ")
    with pytest.raises(ConfigError, match="--engine-api-key instead of --api-key"):
        _config(tiny, "--launch-sglang", "--sglang-args=--api-key=x")


async def test_an_external_engine_with_a_key_is_reached_only_with_it(tiny):
    async with FakeSGLangServer(api_key=KEY) as server:
        cfg = _config(tiny, "--engine-url", server.url, "--engine-api-key", KEY)
        async with rollout_session(cfg, tiny, tiny, cfg.to_namespace()) as client:
            assert await client.get_weight_version() == "default"
        authorized = [r for r in server.requests if r.path == "/model_info"]
        assert authorized and all(r.headers.get("Authorization") == f"Bearer {KEY}" for r in authorized)
        cfg = _config(tiny, "--engine-url", server.url)  # no key: the first control call is refused by name
        with pytest.raises(EngineError, match="401"):
            async with rollout_session(cfg, tiny, tiny, cfg.to_namespace()):
                pass


async def test_the_embedded_engine_requires_the_configured_key(tiny):
    cfg = _config(tiny, "--engine-api-key", KEY, "--engine-max-batch", "2", "--engine-max-seq-len", "128")
    async with rollout_session(cfg, tiny, tiny, cfg.to_namespace()) as client:
        assert await client.get_weight_version() == "default"
        async with aiohttp.ClientSession() as http:
            async with http.get(client.url + "/model_info") as reply:
                assert reply.status == 401
            async with http.get(client.url + "/model_info", headers={"Authorization": f"Bearer {KEY}"}) as reply:
                assert reply.status == 200
