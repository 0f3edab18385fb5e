"""Decode throughput of the embedded engine against transformers' `generate` (batch 1) and against
slot-like KV allocation, multi-turn episodes with the prefix cache on against off, a GRPO group's
prefill with prefix sharing against without, and the concurrent episodes a fixed KV memory serves,
paged against slots, in one run.

    python scripts/bench_engine.py [--size tiny|small] [--new-tokens 64] [--concurrency 1 8 32]
                                   [--cases decode multiturn group capacity] [--episodes 8] [--turns 4]

Builds a random Qwen3-VL checkpoint of the chosen size (transformers, saved with `save_pretrained`,
with the tiny tokenizer and processor files), then measures on the same machine and prompt:

* transformers: greedy `generate` of N new tokens at batch 1 (EOS ignored), tokens / wall time;
* the engine: C concurrent `/generate` requests over loopback HTTP (SGLangClient), N new tokens each
  (EOS ignored), total tokens / wall time, after an untimed warm-up round that compiles the programs.

Both timings include the prompt's prefill (short next to N tokens). Printed: tokens/s, ratio to
transformers, decode steps per token and the compiled-program count (compile time and host
overhead are reported, not hidden). The engine runs twice: with pages of `--page-size` tokens, and
with one page of max_seq_len tokens per request, which is the slot engine before paging (each
request owns one contiguous max_seq_len row; both attend to the same kv-length bucket, max_seq_len),
both alive at once and timed in alternation (best of `--repeats` rounds each); their ratio is the
cost of reading K/V through page tables (issue 18 (d)).

Peer case (`--cases peer --peer-url URL --checkpoint DIR`, issues 27 and 48): the embedded engine on DIR, with
the engine's default buckets, against a real engine serving DIR (vLLM or SGLang, detected), in one run: decode tok/s
at each `--concurrency` over `--repeats` timed repeats per side (default 5) after one untimed warm-up round each, A/B
alternated (the side that goes first alternates too). A repeat runs rounds back to back for at least
`--repeat-seconds` (default 1 s; 0: one round): a single round lasts 40-250 ms, a time scale at which the VM's own
noise spreads fixed Python work by up to 1.7x. Both sides wait `--settle-seconds` (default 1.5) before each timed
repeat: vLLM's worker busy-polls its shared-memory queue for 1 s after its last read (`SpinCondition.busy_loop_s` in
vllm/distributed/device_communicators/shm_broadcast.py), which on two cores takes one from whatever runs next.
Reported: median, min-max and spread (max / min) of the repeats per side (and the repeats in the order they ran),
the ratio of the medians and the spread of single rounds; for the embedded engine also the host's share of its
decode steps (the part outside dispatching and waiting for the decode program: with the overlapped decode, the host
work the device's step did not hide), the share of steps dispatched overlapped, ms per decode step, the
compilations during the timed repeats (jax's compile
events; any on the serving threads is a defect; "+N": N on the engine's side thread, which stall nothing), the
garbage collector's pauses in them, and per repeat the time inside the decode program per step (its spread is the
device's, here the CPU's) and the decode steps per round (the schedule's work); and
the machine's own spread: fixed Python work (one core) and a fixed XLA program (a chain of matmuls on XLA's
threads, as the decode program runs), each as long as a repeat, timed after each A/B pair (floors under both sides'
spreads). After
its warm-up round the embedded engine (and an SGLang peer) freezes its heap (`/freeze_gc`; vLLM freezes its own once
started). Then the prompt tokens prefilled (prompt - cached) for one GRPO group of `--group-size` on one
image prompt. `--launch-vllm PYTHON` starts the vLLM server itself (vLLM's interpreter, e.g. .venv-vllm/bin/python;
fp32, eager, vLLM's default chunked prefill, as issue 48 measured it) instead of `--peer-url`. The load average
before and after is printed: on a shared machine only the ratio of sides timed in alternation means much. vLLM on
CPU needs a head_dim >= 32 checkpoint (`make-tiny --head-dim 32`) and `--enable-prompt-tokens-details` to report
cached tokens.

Overlap case (`--cases overlap`, issue 48): the engine's overlapped decode (step n + 1 dispatched before step n is
read) against one step at a time, two engines on the built or `--checkpoint` model, timed in alternation at each
`--concurrency` (`--repeats` repeats of `--repeat-seconds` each): tok/s, spread, ratio and each one's host share.

Prefill case (`--cases prefill`): short text prompts prefilled one per forward (a CPU's default) against side by
side (`engine_prefill_batch_tokens`, a GPU's and TPU's default; here R x the bucket, so that the R prompts share one
forward), on the model runner directly: R prompts of one `--prefill-bucket` at a time, each runner with its own
cache, timed in alternation (median of `--repeats` x 5 calls
each, after a warm-up), for R in `--prefill-rows`; the ratio, the largest log-prob difference between the two, and
the time of the R prompts in a forward of the largest R rows (padding rows, as a partly filled group runs).

Group case (issue 18 (a)): one GRPO group of n samples (seeded, temperature 1) of a ~1,000-token
prompt with an image, arriving together, on an engine with the radix cache and one without: prompt
tokens prefilled and their ratio.

Capacity case (issue 18 (b)): E concurrent 4-turn episodes on a fixed KV memory of B tokens, paged
(pages of `--page-size`, radix cache on) against slots (one max_seq_len page per request, which
holds B / max_seq_len requests, as `max_batch` slots did): the most requests decoding at once, its
ratio, and the wall time.

Multi-turn case: E concurrent episodes of T turns each, as the rollout runs them: the first prompt
has a long text and an image, every turn generates N tokens and appends an observation (a new image
every other turn), and the next request re-sends the whole conversation. Timed on two engines that
differ only in `prefix_cache`, after an untimed warm-up episode set and a cache flush: wall time,
prefilled and cached prompt tokens, vision-tower images, and the off/on time ratio.

Memory case (`--cases memory`, issue 28): engine memory per concurrent episode against its context length (2k to
32k tokens) for Qwen3.5 against a Qwen3-VL of the same width and depth (transformers' `Qwen3_5TextConfig` defaults:
32 layers of width 4096, 16 heads of 256, 4 kv heads; Qwen3.5's 3 linear : 1 full pattern), read off the shapes of
each family's real `init_cache` (`jax.eval_shape`, nothing allocated): K/V bytes per page and recurrent-state bytes
per request, in bf16 (the recurrent state is fp32). Printed: MiB per episode at each length, their ratio, and how
much faster Qwen3.5's memory grows from the shortest to the longest context.

Weight-update case (issue 18 (c)): a trainer-side copy of the model in this process pushes new weights to the
embedded engine, in turn through the disk (versioned HF export + /update_weights_from_disk) and in memory
(`--weight-sync-mode memory`: the same pause/flush/update/continue sequence and version check), copied (what a
trainer whose step donates its parameters needs) and shared (a trainer that keeps them, as a run with the embedded
engine on its own devices does: the engine serves the trainer's arrays), after one untimed push of each: seconds
per push (best of `WEIGHT_PUSHES`) and the disk/memory ratios (RATIO: disk/shared). Every mode makes those calls on
the engine object in this process, not over HTTP. Run it with `--size small`.
`--json FILE` also writes the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jaxrl_vlm.xla_cpu_cores import confine_xla_threads  # noqa: E402 (imports no jax)

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {},  # tiny_assets defaults: hidden 64, 2 layers
    "small": {"text_config": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 8,
                              "num_key_value_heads": 4, "head_dim": 32,
                              "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [8, 4, 4],
                                                  "mrope_interleaved": True}},
              "vision_config": {"out_hidden_size": 256}},
}


def build_checkpoint(size: str, out: Path) -> Path:
    """A random fp32 Qwen3-VL of `size` saved by transformers, plus tokenizer / processor files."""
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from jaxrl_vlm.tiny_assets import save_tiny_processing, tiny_qwen3_vl_hf_config
    from rollout.processing import load_tokenizer

    # Images up to 256x256 pixels (64 merged tokens each), so the vision tower is not negligible.
    proc = save_tiny_processing(out / "processing", seed=0, max_pixels=256 * 256)
    config = tiny_qwen3_vl_hf_config(load_tokenizer(proc), **SIZES[size])
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**config)).to(torch.float32).eval()
    model.generation_config.eos_token_id = [config["text_config"]["eos_token_id"]]
    model_dir = out / "model"
    model.save_pretrained(str(model_dir))
    for item in proc.iterdir():
        shutil.copy2(item, model_dir / item.name)
    return model_dir


def bench_transformers(model_dir: Path, prompt: list[int], new_tokens: int, repeats: int, threads: int) -> dict[str, float]:
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    torch.set_num_threads(threads)
    model = Qwen3VLForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    x = torch.tensor([prompt])
    kwargs = dict(attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    with torch.no_grad():
        model.generate(input_ids=x, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            out = model.generate(input_ids=x, **kwargs)
            best = min(best, time.perf_counter() - start)
    produced = out.shape[1] - x.shape[1]
    return {"tokens": produced, "seconds": best, "tokens_per_s": produced / best}


async def _round(url: str, prompt: list[int], concurrency: int, new_tokens: int, api: str = "sglang") -> tuple[int, float]:
    from rollout.vllm_client import client_class

    params = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    async with client_class(api)(url, timeout_s=600) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(client.generate(prompt, sampling_params=params) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return sum(len(r.output_ids) for r in results), elapsed


# Serves a model with the engine of another checkout (PYTHONPATH), prints its URL, stops when stdin closes.
_OTHER_ENGINE = """
import sys
from jaxrl_vlm.engine import EmbeddedEngine, EngineOptions
model_dir, max_batch, max_seq_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with EmbeddedEngine(model_dir, config=EngineOptions(max_batch=max_batch, max_seq_len=max_seq_len,
                                                    min_kv_bucket=max_seq_len)) as engine:
    print(engine.url, flush=True)
    sys.stdin.read()
"""


class _OtherCheckoutEngine:
    """The engine of another checkout (e.g. the main branch before paging) in a subprocess, with the
    options both versions know: max_batch, max_seq_len, min_kv_bucket = max_seq_len."""

    def __init__(self, checkout: str, model_dir: Path, max_batch: int, max_seq_len: int):
        import subprocess

        env = {**os.environ, "PYTHONPATH": os.path.abspath(checkout)}
        self.proc = subprocess.Popen([sys.executable, "-c", _OTHER_ENGINE, str(model_dir), str(max_batch), str(max_seq_len)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        self.url = self.proc.stdout.readline().strip()
        if not self.url.startswith("http"):
            raise RuntimeError(f"the engine of {checkout} did not start (exit {self.proc.poll()})")
        self.stats = None

    def __enter__(self) -> "_OtherCheckoutEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def bench_engine(model_dir: Path, prompt: list[int], new_tokens: int, concurrencies: list[int], repeats: int,
                 page_sizes: dict[str, int | None], other_checkout: str | None = None) -> dict[str, list[dict[str, Any]]]:
    """Decode rounds at each concurrency on one engine per entry of `page_sizes` (None: one page of
    max_seq_len per request, i.e. slots), plus ("checkout") the engine of `other_checkout` if given,
    all alive at once and timed in alternation, so that load from other processes hits them alike."""
    import contextlib

    from jaxrl_vlm.engine import EmbeddedEngine, EngineOptions

    max_batch = max(concurrencies)
    # One kv bucket (= max_seq_len) so that paged and slot layouts attend to the same number of keys.
    max_seq_len = -(-(len(prompt) + new_tokens + 1) // 64) * 64
    names = [*page_sizes, *(["checkout"] if other_checkout else [])]
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    with contextlib.ExitStack() as stack:
        engines: dict[str, Any] = {name: stack.enter_context(EmbeddedEngine(str(model_dir), config=EngineOptions(
            max_batch=max_batch, max_seq_len=max_seq_len, min_kv_bucket=max_seq_len, page_size=size or max_seq_len)))
            for name, size in page_sizes.items()}
        if other_checkout:
            engines["checkout"] = stack.enter_context(_OtherCheckoutEngine(other_checkout, model_dir, max_batch, max_seq_len))
        for c in concurrencies:
            warmup_s, best, steps, tokens = {}, {}, {}, {}
            for name, engine in engines.items():
                compile_start = time.perf_counter()
                asyncio.run(_round(engine.url, prompt, c, new_tokens))  # compiles this concurrency's programs
                warmup_s[name], best[name] = time.perf_counter() - compile_start, float("inf")
            for _ in range(repeats):
                for name, engine in engines.items():
                    before = engine.stats.decode_steps if engine.stats else 0
                    tokens[name], elapsed = asyncio.run(_round(engine.url, prompt, c, new_tokens))
                    if elapsed < best[name]:
                        best[name], steps[name] = elapsed, (engine.stats.decode_steps - before if engine.stats else 0)
            for name, engine in engines.items():
                rows[name].append({"concurrency": c, "tokens": tokens[name], "seconds": best[name],
                                   "tokens_per_s": tokens[name] / best[name], "decode_steps": steps[name],
                                   "ms_per_decode_step": 1e3 * best[name] / max(1, steps[name]), "warmup_s": warmup_s[name],
                                   "compiled_programs": engine.engine.runner.num_programs if engine.stats else 0})
    return rows


def _picture(seed: int) -> Any:
    """A deterministic 256x224 test picture (smooth gradients plus blocky noise)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:224, 0:256].astype(np.float32)
    freq = rng.uniform(0.02, 0.2, size=(3, 2))
    base = np.stack([127.5 + 90.0 * np.sin(freq[c, 0] * xx + freq[c, 1] * yy + c) for c in range(3)], axis=-1)
    noise = rng.integers(-30, 31, size=(28, 32, 3)).repeat(8, 0).repeat(8, 1)
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))


async def _episodes(url: str, encoder: Any, episodes: int, turns: int, new_tokens: int, seed: int) -> tuple[int, float]:
    """Run `episodes` concurrent episodes of `turns` turns; returns (generated tokens, wall seconds)."""
    from rollout.client import SGLangClient

    params = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    question = "Read the figure and the statement carefully. " * 12

    async def one(client: SGLangClient, e: int) -> int:
        image = {"type": "image", "image": _picture(seed + 100 * e)}
        seg = encoder.encode_prompt([{"role": "user", "content": [{"type": "text", "text": f"Problem {e}. {question}"}, image,
                                                                  {"type": "text", "text": "Find x."}]}])
        ids, images, produced = list(seg.wire_ids), list(seg.image_data), 0
        for t in range(turns):
            result = await client.generate(ids, image_data=images, sampling_params=params)
            produced += len(result.output_ids)
            content: list[dict[str, Any]] = [{"type": "text", "text": f"Turn {t}: that is not right, look again at the angles."}]
            if t % 2 == 0:
                content.insert(0, {"type": "image", "image": _picture(seed + 100 * e + t + 1)})
            obs = encoder.encode_observation([{"role": "user", "content": content}], model_ended_turn=False)
            ids += result.output_ids + obs.wire_ids
            images += obs.image_data
        return produced

    async with SGLangClient(url, timeout_s=600) as client:
        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(client, e) for e in range(episodes)))
        return sum(tokens), time.perf_counter() - start


async def _flush(url: str) -> None:
    from rollout.client import SGLangClient

    async with SGLangClient(url) as client:
        if not await client.flush_cache():
            raise RuntimeError("flush_cache refused on an idle engine")


def bench_multiturn(model_dir: Path, encoder: Any, episodes: int, turns: int, new_tokens: int, repeats: int) -> dict[str, Any]:
    """The same episodes on an engine with the prefix cache and one without (same config otherwise)."""
    from jaxrl_vlm.engine import EmbeddedEngine, EngineOptions

    rows: dict[str, Any] = {}
    for name, enabled in (("off", False), ("on", True)):
        config = EngineOptions(max_batch=max(episodes, 1), max_seq_len=2048, min_kv_bucket=256, prefix_cache=enabled)
        with EmbeddedEngine(str(model_dir), config=config) as engine:
            warm_start = time.perf_counter()
            asyncio.run(_episodes(engine.url, encoder, episodes, turns, new_tokens, seed=10_000))  # compiles
            warmup_s = time.perf_counter() - warm_start
            best: dict[str, Any] | None = None
            for r in range(repeats):
                asyncio.run(_flush(engine.url))  # every timed round starts from an empty cache
                s = engine.stats
                before = (s.prefilled_tokens, s.cached_tokens, s.encoded_images, s.prefix_hits)
                tokens, elapsed = asyncio.run(_episodes(engine.url, encoder, episodes, turns, new_tokens, seed=r))
                if best is None or elapsed < best["seconds"]:
                    best = {"seconds": elapsed, "tokens": tokens, "prefilled_tokens": s.prefilled_tokens - before[0],
                            "cached_tokens": s.cached_tokens - before[1], "encoded_images": s.encoded_images - before[2],
                            "prefix_hits": s.prefix_hits - before[3]}
            rows[name] = {**best, "warmup_s": warmup_s, "compiled_programs": engine.engine.runner.num_programs}
    rows["speedup"] = rows["off"]["seconds"] / rows["on"]["seconds"]
    return rows


# Pushes timed per mode in the weight-update case (alternating, best of): one push is milliseconds, so many are cheap
# and the minimum rides out a machine shared with other work.
WEIGHT_PUSHES = 10


def bench_weight_update(model_dir: Path, repeats: int, scratch: Path) -> dict[str, Any]:
    """Seconds per weight push (export or staging + update + version check), disk against memory; and the weight
    movement alone (export + the engine's read into its shardings, against staging device to device)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxrl_vlm.engine import EmbeddedEngine, EngineOptions
    from jaxrl_vlm.engine.weights import load_params_state
    from jaxrl_vlm.models.hf_io import from_hf
    from jaxrl_vlm.weight_sync import WeightSyncer, export_version
    from rollout.client import SGLangClient

    trainer_model = from_hf(str(model_dir))
    with EmbeddedEngine(str(model_dir), config=EngineOptions(max_batch=8, max_seq_len=512)) as engine:

        async def run() -> dict[str, Any]:
            async with SGLangClient(engine.url) as client:
                client.local_engine = engine.engine
                syncers = {mode: WeightSyncer(client, scratch / "weights", copy_from=str(model_dir), dtype=jnp.float32,
                                              mode="disk" if mode == "disk" else "memory")
                           for mode in ("disk", "memory", "shared")}
                # A trainer that keeps its parameters (no donation: `Trainer.share_params`) hands them over uncopied.
                syncers["shared"].share_trainer_arrays = True
                times: dict[str, list[float]] = {mode: [] for mode in syncers}
                version = 0
                for rep in range(repeats + 1):
                    for mode, syncer in syncers.items():
                        version += 1
                        t0 = time.perf_counter()
                        report = await syncer.push(trainer_model, version)
                        if rep:  # the first push of each compiles nothing but warms caches: untimed
                            times[mode].append(time.perf_counter() - t0)
                        assert report.in_memory == (mode != "disk")
                return {mode: {"seconds": min(t), "bytes_written": syncers[mode].history[-1].bytes_written}
                        for mode, t in times.items()}

        out = asyncio.run(run())
        runner, params = engine.engine.runner, nnx.state(trainer_model, nnx.Param)
        moves: dict[str, list[float]] = {"disk": [], "memory": []}
        for rep in range(repeats + 1):
            t0 = time.perf_counter()
            path = export_version(trainer_model, scratch / "moves", rep, dtype=jnp.float32, copy_from=str(model_dir))
            jax.block_until_ready(load_params_state(path, runner.cfg, runner.params))  # read, not swapped in
            t1 = time.perf_counter()
            engine.engine.stage_weights("bench", params)  # blocks until the copies are on the engine's devices
            t2 = time.perf_counter()
            engine.engine.discard_staged("bench")
            if rep:
                moves["disk"].append(t1 - t0)
                moves["memory"].append(t2 - t1)
    out["ratio"] = out["disk"]["seconds"] / out["shared"]["seconds"]
    out["copy_ratio"] = out["disk"]["seconds"] / out["memory"]["seconds"]
    out["move"] = {mode: min(t) for mode, t in moves.items()}
    out["move_ratio"] = out["move"]["disk"] / out["move"]["memory"]
    return out


def _group_prompt(encoder: Any, target_tokens: int, seed: int) -> tuple[list[int], list[str]]:
    """Wire ids and image data of a ~target_tokens prompt (pads expanded) with one picture."""
    image = {"type": "image", "image": _picture(seed)}
    words, seg = 8, None
    while True:
        text = "Study the figure and every given length, then reason step by step. " * words
        seg = encoder.encode_prompt([{"role": "user", "content": [{"type": "text", "text": text}, image,
                                                                  {"type": "text", "text": "What is the value of x?"}]}])
        if len(seg.train_ids) >= target_tokens:
            return list(seg.wire_ids), list(seg.image_data)
        words = max(words + 1, int(words * target_tokens / len(seg.train_ids)))


async def _group(url: str, ids: list[int], images: list[str], n: int, new_tokens: int, api: str = "sglang") -> list[Any]:
    from rollout.vllm_client import client_class

    async with client_class(api)(url, timeout_s=600) as client:
        return await asyncio.gather(*(client.generate(ids, image_data=images, sampling_params={
            "temperature": 1.0, "max_new_tokens": new_tokens, "ignore_eos": True, "sampling_seed": i}) for i in range(n)))


def bench_group(model_dir: Path, encoder: Any, n: int, prompt_tokens: int, new_tokens: int, page_size: int) -> dict[str, Any]:
    """Prompt tokens prefilled for one group of n samples arriving together, radix cache on against off."""
    from jaxrl_vlm.engine import EmbeddedEngine, EngineOptions

    ids, images = _group_prompt(encoder, prompt_tokens, seed=7)
    rows: dict[str, Any] = {}
    for name, enabled in (("off", False), ("on", True)):
        config = EngineOptions(max_batch=n, max_seq_len=2048, min_kv_bucket=256, page_size=page_size, prefix_cache=enabled)
        with EmbeddedEngine(str(model_dir), config=config) as engine:
            s = engine.stats
            before = (s.prefilled_tokens, s.encoded_images)
            start = time.perf_counter()
            results = asyncio.run(_group(engine.url, ids, images, n, new_tokens))  # compiles, then runs
            rows[name] = {"seconds_with_compile": time.perf_counter() - start, "prefilled_tokens": s.prefilled_tokens - before[0],
                          "encoded_images": s.encoded_images - before[1],
                          "cached_tokens": sum(r.cached_tokens for r in results), "prompt_tokens": results[0].prompt_tokens}
    rows["ratio"] = rows["off"]["prefilled_tokens"] / rows["on"]["prefilled_tokens"]
    return rows


def _load() -> str:
    """The machine's 1/5/15-minute load averages and core count, for the record of a timing."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.1f} / {five:.1f} / {fifteen:.1f} on {os.cpu_count()} cores"


class _CompileCounter:
    """Backend compilations in this process (jax's monitoring event), for "no compilation after warm-up": `count`
    on the threads that serve requests (each one stalls them), `background` on the engine's side thread (a decode
    bucket in steady use, compiled while a larger program serves it; `jaxrl_vlm/engine/background_compile.py`)."""

    def __init__(self) -> None:
        import jax

        from jaxrl_vlm.engine.background_compile import THREAD_NAME

        self.count = self.background = 0
        self._background_thread = THREAD_NAME
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration_s: float, **_: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            if threading.current_thread().name == self._background_thread:
                self.background += 1
            else:
                self.count += 1


def _fixed_work_seconds(loops: int = 400_000) -> float:
    """Seconds one fixed piece of single-threaded Python work takes now (about 30 ms per 400,000 loops on the 2-core
    machine): timed beside the repeats, its spread is the machine's own, the floor under any engine's spread."""
    start = time.perf_counter()
    total = 0
    for i in range(loops):
        total += i & 7
    return time.perf_counter() - start


def _fixed_work_loops(seconds: float) -> int:
    """Loops of `_fixed_work_seconds` that last about `seconds` now (at least 400,000): the machine's spread is
    measured on the time scale of the repeats it is the floor of."""
    return max(400_000, int(400_000 * seconds / _fixed_work_seconds()))


_XLA_WORK_SIZE = 384  # matrices of the fixed XLA work: big enough that XLA's CPU matmul uses every core


@functools.lru_cache(maxsize=1)
def _xla_work() -> tuple[Any, Any]:
    """A jitted chain of `loops` (a traced count: one program for any length) [384, 384] matmuls, and its input."""
    import jax
    import jax.numpy as jnp

    def chain(x, loops):
        return jax.lax.fori_loop(0, loops, lambda _, y: jnp.tanh(y @ x), x)

    x = jax.random.normal(jax.random.key(0), (_XLA_WORK_SIZE, _XLA_WORK_SIZE), jnp.float32) / _XLA_WORK_SIZE ** 0.5
    return jax.jit(chain), x


def _fixed_xla_seconds(loops: int = 8) -> float:
    """Seconds one fixed XLA program takes now, on every core XLA's CPU client uses (the decode program's threads):
    the machine's floor for a multi-threaded program, where `_fixed_work_seconds` times one core."""
    program, x = _xla_work()
    start = time.perf_counter()
    program(x, loops).block_until_ready()
    return time.perf_counter() - start


def _fixed_xla_loops(seconds: float) -> int:
    """Loops of `_fixed_xla_seconds` that last about `seconds` now (after a compiling call)."""
    _fixed_xla_seconds()
    return max(8, int(8 * seconds / _fixed_xla_seconds()))


def _spread(values: list[float]) -> dict[str, Any]:
    import statistics

    return {"runs": values, "median": statistics.median(values), "min": min(values), "max": max(values),
            "spread": max(values) / min(values)}


async def _repeat(url: str, prompt: list[int], concurrency: int, new_tokens: int, api: str,
                  min_seconds: float) -> tuple[float, list[float]]:
    """One timed repeat: rounds of `concurrency` requests back to back until `min_seconds` have passed (at least one
    round). Returns the repeat's tok/s (all its tokens over its whole time) and each round's."""
    tokens, seconds, rounds = 0, 0.0, []
    while not rounds or seconds < min_seconds:
        t, s = await _round(url, prompt, concurrency, new_tokens, api)
        tokens, seconds = tokens + t, seconds + s
        rounds.append(t / s)
    return tokens / seconds, rounds


async def _freeze_gc(url: str) -> None:
    from rollout.client import SGLangClient

    async with SGLangClient(url) as client:
        await client.freeze_gc()


def bench_peer(model_dir: Path, encoder: Any, peer_url: str, prompt: list[int], new_tokens: int, concurrencies: list[int],
               repeats: int, repeat_seconds: float, settle_seconds: float, group_size: int,
               group_prompt_tokens: int, freeze_gc: bool = True) -> dict[str, Any]:
    """The embedded engine against a real server (`peer_url`, serving `model_dir`; its API detected), in one run:
    decode tok/s at each concurrency over `repeats` timed repeats of at least `repeat_seconds` each (rounds back to
    back) after one untimed warm-up round each, A/B alternated (the side that goes first alternates too), as median,
    min, max and spread (max / min) per side, and the spread of single rounds; for the embedded engine also the host's
    share of its decode steps (time outside dispatching and waiting for the decode program), the share of steps
    dispatched overlapped, ms per decode step, the compilations during
    the timed repeats (each one a defect: the warm-up round compiles what a concurrency needs) and the garbage
    collector's pauses in them. After each warm-up the embedded engine, and an SGLang peer, freeze their heaps
    (`/freeze_gc`; vLLM freezes its own once started). Then the prompt tokens prefilled for a GRPO group of
    `group_size` on one image prompt (prompt - cached tokens). Both servers sit idle for `settle_seconds` before each
    timed repeat and each piece of fixed work, so neither runs while the other still spins down."""
    from jaxrl_vlm.engine import EmbeddedEngine, EngineOptions
    from jaxrl_vlm.gc_heap import GcPauses
    from rollout.vllm_client import detect_engine_api

    compiles = _CompileCounter()
    api = asyncio.run(detect_engine_api(peer_url))
    config = EngineOptions(max_batch=max(max(concurrencies), group_size), max_seq_len=2048, freeze_gc=freeze_gc)
    out: dict[str, Any] = {"peer_api": api, "decode": [], "group": {}, "load_before": _load(),
                           "repeat_seconds": repeat_seconds, "settle_seconds": settle_seconds, "freeze_gc": freeze_gc}
    ids, images = _group_prompt(encoder, group_prompt_tokens, seed=7)
    loops, xla_loops = _fixed_work_loops(repeat_seconds), _fixed_xla_loops(repeat_seconds)
    with EmbeddedEngine(str(model_dir), config=config) as engine:
        runner, sched = engine.engine.runner, engine.engine.scheduler
        urls = {"embedded": (engine.url, "sglang"), "peer": (peer_url, api)}
        for c in concurrencies:
            for name, (url, kind) in urls.items():
                asyncio.run(_round(url, prompt, c, new_tokens, kind))  # warm-up (compiles the embedded engine's programs)
                if kind == "sglang" and freeze_gc:
                    asyncio.run(_freeze_gc(url))
            runs: dict[str, list[float]] = {name: [] for name in urls}
            rounds: dict[str, list[float]] = {name: [] for name in urls}
            fixed: list[float] = []  # the machine's noise: fixed work, timed after each A/B pair
            fixed_xla: list[float] = []  # the same for a fixed XLA program on XLA's threads
            program_ms: list[float] = []  # per embedded repeat: ms per decode step in the program (dispatch + wait)
            steps_per_round: list[float] = []  # per embedded repeat: decode steps per round (the schedule's work)
            programs, compiled, background = runner.num_programs, compiles.count, compiles.background
            steps, step_s, program_s = sched.timing.decode_steps, sched.timing.decode_s, runner.decode_program_s
            overlapped = sched.stats.overlapped_steps
            with GcPauses() as pauses:
                for r in range(repeats):
                    for name in (list(urls) if r % 2 == 0 else list(urls)[::-1]):
                        url, kind = urls[name]
                        time.sleep(settle_seconds)
                        before = (sched.timing.decode_steps, runner.decode_program_s)
                        tok_s, each = asyncio.run(_repeat(url, prompt, c, new_tokens, kind, repeat_seconds))
                        runs[name].append(tok_s)
                        rounds[name].extend(each)
                        if name == "embedded":  # the device's time per decode step in this repeat
                            n = sched.timing.decode_steps - before[0]
                            program_ms.append(1e3 * (runner.decode_program_s - before[1]) / max(1, n))
                            steps_per_round.append(n / len(each))
                    time.sleep(settle_seconds)
                    fixed.append(1.0 / _fixed_work_seconds(loops))
                    fixed_xla.append(1.0 / _fixed_xla_seconds(xla_loops))
            steps = sched.timing.decode_steps - steps
            step_s, program_s = sched.timing.decode_s - step_s, runner.decode_program_s - program_s
            overlapped = (sched.stats.overlapped_steps - overlapped) / max(1, steps)
            row = {"concurrency": c, **{name: _spread(v) for name, v in runs.items()}, "machine": _spread(fixed),
                   "machine_xla": _spread(fixed_xla),
                   "program_ms_per_step": _spread(program_ms), "steps_per_round": _spread(steps_per_round),
                   "overlapped_share": overlapped,
                   "rounds": {name: _spread(v) for name, v in rounds.items()},
                   "host_share": 1.0 - program_s / step_s, "ms_per_decode_step": 1e3 * step_s / max(1, steps),
                   "new_programs": runner.num_programs - programs, "compilations": compiles.count - compiled,
                   "background_compilations": compiles.background - background,
                   "gc": {"collections": pauses.count, "total_s": pauses.total_s, "longest_s": pauses.longest_s}}
            row["ratio"] = row["embedded"]["median"] / row["peer"]["median"]
            out["decode"].append(row)
        for name, (url, kind) in urls.items():
            results = asyncio.run(_group(url, ids, images, group_size, 8, kind))
            out["group"][name] = {"prompt_tokens": results[0].prompt_tokens,
                                  "prefilled": sum(r.prompt_tokens - r.cached_tokens for r in results)}
    out["group"]["ratio"] = out["group"]["peer"]["prefilled"] / out["group"]["embedded"]["prefilled"]
    out["load_after"] = _load()
    return out


def bench_overlap(model_dir: Path, prompt: list[int], new_tokens: int, concurrencies: list[int], repeats: int,
                  repeat_seconds: float) -> dict[str, Any]:
    """The overlapped decode against one step at a time (`overlap_schedule` on and off): two engines with the
    engine's default buckets, alive at once, timed in alternation at each concurrency (`repeats` repeats of at
    least `repeat_seconds` of back-to-back rounds each, after a warm-up round), with each one's host share."""
    import contextlib

    from jaxrl_vlm.engine import EmbeddedEngine, EngineOptions

    modes = {"overlap": True, "serial": False}
    out: dict[str, Any] = {"load_before": _load(), "rows": []}
    with contextlib.ExitStack() as stack:
        engines = {name: stack.enter_context(EmbeddedEngine(str(model_dir), config=EngineOptions(
            max_batch=max(concurrencies), max_seq_len=2048, overlap_schedule=on))) for name, on in modes.items()}
        for c in concurrencies:
            for engine in engines.values():
                asyncio.run(_round(engine.url, prompt, c, new_tokens))  # warm-up: compiles
                asyncio.run(_freeze_gc(engine.url))
            runs: dict[str, list[float]] = {name: [] for name in engines}
            before = {name: (e.engine.scheduler.timing.decode_s, e.engine.runner.decode_program_s)
                      for name, e in engines.items()}
            for r in range(repeats):
                for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                    runs[name].append(asyncio.run(_repeat(engines[name].url, prompt, c, new_tokens, "sglang",
                                                          repeat_seconds))[0])
            row: dict[str, Any] = {"concurrency": c}
            for name, e in engines.items():
                step_s = e.engine.scheduler.timing.decode_s - before[name][0]
                program_s = e.engine.runner.decode_program_s - before[name][1]
                row[name] = {**_spread(runs[name]), "host_share": 1.0 - program_s / step_s}
            row["ratio"] = row["overlap"]["median"] / row["serial"]["median"]
            out["rows"].append(row)
    out["load_after"] = _load()
    return out


def bench_prefill(model_dir: Path, bucket: int, row_counts: list[int], repeats: int) -> dict[str, Any]:
    """R text prompts of `bucket` tokens (bucket - 3 real ones each, pages of their own) prefilled one per forward
    against side by side (all R in one forward: `prefill_batch_tokens` R x bucket) and in a forward of the largest R
    rows (padded, as a partly filled group runs), three runners of one model, alternated."""
    import statistics

    import numpy as np

    from jaxrl_vlm.engine import EngineOptions
    from jaxrl_vlm.engine.runner import FloatRow, IntRow, ModelRunner, PrefillRow
    from jaxrl_vlm.models import from_hf

    model = from_hf(str(model_dir))
    base = EngineOptions(max_batch=max(row_counts), max_seq_len=2 * bucket, min_prefill_bucket=bucket,
                         min_kv_bucket=2 * bucket)
    one = ModelRunner(model, dataclasses.replace(base, prefill_batch_tokens=0), ())
    widest = ModelRunner(model, dataclasses.replace(base, prefill_batch_tokens=max(row_counts) * bucket), ())
    rng = np.random.default_rng(0)
    ints, floats = np.zeros((len(IntRow),), np.int32), np.zeros((len(FloatRow),), np.float32)
    ints[IntRow.TOP_K], floats[FloatRow.TOP_P] = -1, 1.0
    pages_per_row = -(-2 * bucket // base.page_size)
    out: dict[str, Any] = {"bucket": bucket, "load_before": _load(), "rows": []}
    for n in row_counts:
        rows = [PrefillRow(r, list(range(r * pages_per_row, (r + 1) * pages_per_row)),
                           rng.integers(0, 200, size=bucket - 3).astype(np.int32),
                           np.broadcast_to(np.arange(bucket - 3, dtype=np.int32), (3, bucket - 3)), None, None,
                           ints, floats) for r in range(n)]
        runners = {"one": one, "side": ModelRunner(model, dataclasses.replace(base, prefill_batch_tokens=n * bucket), ()),
                   "padded": widest}
        seconds: dict[str, list[float]] = {name: [] for name in runners}
        logprobs = {}
        for name, runner in runners.items():  # warm-up: compiles
            logprobs[name] = [lp for _, lp in runner.prefill_rows([runner.prepare_prefill(r) for r in rows])]
        for _ in range(repeats * 5):
            for name, runner in runners.items():
                start = time.perf_counter()
                runner.prefill_rows([runner.prepare_prefill(r) for r in rows])
                seconds[name].append(time.perf_counter() - start)
        one_s, side_s, padded_s = (statistics.median(seconds[k]) for k in ("one", "side", "padded"))
        out["rows"].append({"rows": n, "one_ms": 1e3 * one_s, "side_ms": 1e3 * side_s, "ratio": one_s / side_s,
                            "padded_ms": 1e3 * padded_s,
                            "max_logprob_diff": float(np.max(np.abs(np.subtract(logprobs["one"], logprobs["side"]))))})
    out["load_after"] = _load()
    return out


class _LaunchedVLLM:
    """vLLM's server on `model_dir` from the interpreter `python` (`jaxrl_vlm.vllm_launcher`) as issue 48 measured
    it: fp32, eager, vLLM's own scheduler defaults (chunked prefill on), 1 GiB of KV cache; for `--cases peer
    --launch-vllm`. (tests/vllm_real turns chunked prefill off for exact parity; a throughput race should not.)"""

    ARGS = ["--max-model-len", "2048", "--enforce-eager", "--dtype", "float32", "--enable-prompt-tokens-details"]

    def __init__(self, python: str, model_dir: Path, log_path: Path):
        from jaxrl_vlm.vllm_launcher import VLLMProcess

        self.server = VLLMProcess(python, str(model_dir), extra_args=list(self.ARGS), log_path=log_path)
        self.server.extra_env = {**self.server.extra_env, "VLLM_CPU_KVCACHE_SPACE": "1"}

    def __enter__(self) -> str:
        from rollout.vllm_client import VLLMClient

        url = self.server.start()

        async def ready() -> None:
            async with VLLMClient(url) as client:
                await self.server.wait_ready(client, timeout_s=600.0)

        try:
            asyncio.run(ready())
        except BaseException:
            self.server.stop()
            raise
        return url

    def __exit__(self, *exc: Any) -> None:
        self.server.stop()


def bench_capacity(model_dir: Path, encoder: Any, episodes: int, turns: int, new_tokens: int, memory_tokens: int,
                   max_seq_len: int, page_size: int) -> dict[str, Any]:
    """The same concurrent episodes on a KV memory of `memory_tokens`: slots (one max_seq_len page per
    request) against pages of `page_size` with the radix cache."""
    from jaxrl_vlm.engine import EmbeddedEngine, EngineOptions

    rows: dict[str, Any] = {}
    for name, size in (("slots", max_seq_len), ("paged", page_size)):
        config = EngineOptions(max_batch=episodes, max_seq_len=max_seq_len, min_kv_bucket=256, page_size=size,
                               max_total_tokens=memory_tokens, decode_batch_sizes=tuple(sorted({8, 16, 32, episodes})))
        with EmbeddedEngine(str(model_dir), config=config) as engine:
            warm_start = time.perf_counter()
            asyncio.run(_episodes(engine.url, encoder, min(episodes, 4), turns, new_tokens, seed=10_000))  # compiles
            warmup_s = time.perf_counter() - warm_start
            asyncio.run(_flush(engine.url))
            s = engine.stats
            s.max_decode_rows = 0
            before = (s.prefilled_tokens, s.cached_tokens, s.retractions)
            tokens, elapsed = asyncio.run(_episodes(engine.url, encoder, episodes, turns, new_tokens, seed=1))
            rows[name] = {"max_concurrent": s.max_decode_rows, "seconds": elapsed, "tokens": tokens,
                          "prefilled_tokens": s.prefilled_tokens - before[0], "cached_tokens": s.cached_tokens - before[1],
                          "retractions": s.retractions - before[2], "pages": config.num_pages, "page_size": size,
                          "warmup_s": warmup_s}
    rows["ratio"] = rows["paged"]["max_concurrent"] / rows["slots"]["max_concurrent"]
    rows["speedup"] = rows["slots"]["seconds"] / rows["paged"]["seconds"]
    return rows


def _same_shape_configs() -> tuple[Any, Any]:
    """(Qwen3.5, Qwen3-VL) configs of the same width, depth, heads and head size: transformers' Qwen3.5 defaults."""
    from transformers import Qwen3_5Config, Qwen3VLConfig

    from jaxrl_vlm.models.config import from_hf_dict

    hybrid = Qwen3_5Config().to_dict()
    t = hybrid["text_config"]
    hybrid["vision_config"]["out_hidden_size"] = t["hidden_size"]  # transformers' defaults mix two sizes
    same = {k: t[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                              "num_attention_heads", "num_key_value_heads", "head_dim")}
    section = [48, 40, 40]  # full rotary over head_dim 256: sums to 128
    full = Qwen3VLConfig(text_config=dict(same, rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                                                 "mrope_section": section, "mrope_interleaved": True}),
                         vision_config={"out_hidden_size": t["hidden_size"]})
    return from_hf_dict(hybrid), from_hf_dict(full.to_dict())


def _cache_costs(cfg: Any, page_size: int) -> tuple[float, float]:
    """(bytes per KV page, bytes per request's state row) of `cfg`'s engine cache, from its abstract shapes."""
    import jax
    import jax.numpy as jnp

    from jaxrl_vlm.engine import forward

    def nbytes(pages: int, rows: int) -> int:
        shapes = jax.eval_shape(lambda: forward.init_cache(cfg, pages, page_size, rows, jnp.bfloat16))
        return sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(shapes))

    base = nbytes(8, 8)
    return (nbytes(16, 8) - base) / 8, (nbytes(8, 16) - base) / 8


def bench_memory(contexts: list[int], page_size: int) -> dict[str, Any]:
    hybrid, full = _same_shape_configs()
    rows = []
    costs = {name: _cache_costs(cfg, page_size) for name, cfg in (("qwen3_5", hybrid), ("qwen3_vl", full))}
    for ctx in contexts:
        pages = -(-ctx // page_size)
        per = {name: pages * page + row for name, (page, row) in costs.items()}
        rows.append({"context": ctx, **{f"{k}_mib": v / 2**20 for k, v in per.items()},
                     "ratio": per["qwen3_vl"] / per["qwen3_5"]})
    growth = {k: rows[-1][f"{k}_mib"] - rows[0][f"{k}_mib"] for k in costs}
    return {"rows": rows, "page_bytes": {k: c[0] for k, c in costs.items()},
            "state_row_bytes": {k: c[1] for k, c in costs.items()},
            "growth_ratio": growth["qwen3_vl"] / growth["qwen3_5"],
            "layers": hybrid.text.num_hidden_layers, "full_layers": hybrid.text.layer_types.count("full_attention")}


def _print_memory(m: dict[str, Any], json_path: str | None) -> int:
    print(f"\nengine memory per concurrent episode (bf16 K/V, fp32 recurrent state; {m['layers']} layers, Qwen3.5 with "
          f"{m['full_layers']} full-attention layers; K/V page bytes {m['page_bytes']}, state row bytes "
          f"{m['state_row_bytes']})")
    print("| context | Qwen3-VL MiB | Qwen3.5 MiB | ratio |")
    print("|---:|---:|---:|---:|")
    for r in m["rows"]:
        print(f"| {r['context']:,} | {r['qwen3_vl_mib']:.1f} | {r['qwen3_5_mib']:.1f} | {r['ratio']:.2f}x |")
    first, last = m["rows"][0]["context"], m["rows"][-1]["context"]
    print(f"growth from {first:,} to {last:,} tokens: Qwen3-VL / Qwen3.5 = {m['growth_ratio']:.2f}x")
    if json_path:
        Path(json_path).write_text(json.dumps({"memory": m}, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--repeats", type=int, default=None, help="Timed rounds (default 2; 5 for the peer case).")
    p.add_argument("--repeat-seconds", type=float, default=1.0, help="Peer case: each timed repeat runs rounds back to "
                   "back for at least this long (0: one round, 40-250 ms here, where the VM's own noise spreads fixed "
                   "work by up to 1.7x).")
    p.add_argument("--no-freeze-gc", action="store_true", help="Peer case: the embedded engine with "
                   "engine_freeze_gc off and no /freeze_gc after warm-up (the collector's full pauses come back: see "
                   "the gc column).")
    p.add_argument("--settle-seconds", type=float, default=1.5, help="Peer case: both servers idle this long before "
                   "each timed repeat (vLLM's worker busy-polls its shared-memory queue for 1 s after its last read, "
                   "taking a core of this machine's two from whatever runs next).")
    p.add_argument("--torch-threads", type=int, default=max(1, os.cpu_count() or 1))
    p.add_argument("--cases", nargs="+", choices=("decode", "multiturn", "group", "capacity", "weights", "peer", "memory",
                                                  "overlap", "prefill"),
                   default=["decode", "multiturn", "group", "capacity"])
    p.add_argument("--page-size", type=int, default=16, help="Tokens per KV page of the paged engine.")
    p.add_argument("--baseline-checkout", default=None, metavar="DIR",
                   help="Decode case: also time the engine of this checkout (e.g. a worktree of the commit before "
                        "paging), on the same config, in alternation with this one.")
    p.add_argument("--prefill-bucket", type=int, default=64, help="Prompt bucket (tokens) of the prefill case.")
    p.add_argument("--prefill-rows", type=int, nargs="+", default=[1, 4, 8, 16], help="Prompts per call, prefill case.")
    p.add_argument("--group-size", type=int, default=8, help="Samples of the GRPO group case.")
    p.add_argument("--group-prompt-tokens", type=int, default=1000, help="Prompt tokens (image pads expanded) of the group case.")
    p.add_argument("--capacity-episodes", type=int, default=64, help="Concurrent episodes sent in the capacity case.")
    p.add_argument("--capacity-memory", type=int, default=8 * 2048,
                   help="KV memory (tokens) of the capacity case: 8 slots of its max_seq_len 2048.")
    p.add_argument("--episodes", type=int, default=8, help="Concurrent episodes of the multi-turn case.")
    p.add_argument("--turns", type=int, default=4, help="Turns per episode of the multi-turn case.")
    p.add_argument("--turn-tokens", type=int, default=32, help="New tokens per turn of the multi-turn case.")
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768],
                   help="Context lengths (tokens) of the memory case.")
    p.add_argument("--json", default=None, help="Also write the results to this file.")
    p.add_argument("--peer-url", default=None, help="A real engine (vLLM or SGLang) serving --checkpoint: `--cases peer` "
                   "compares the embedded engine with it (decode tok/s at --concurrency, GRPO group prefill).")
    p.add_argument("--launch-vllm", default=None, metavar="PYTHON", help="`--cases peer` against a vLLM server this "
                   "script starts on --checkpoint with vLLM's interpreter PYTHON (e.g. .venv-vllm/bin/python), instead "
                   "of --peer-url.")
    p.add_argument("--checkpoint", default=None, help="Use this checkpoint instead of building one of --size (the one "
                   "--peer-url serves; e.g. `jaxrl-vlm make-tiny DIR --head-dim 32` for vLLM on CPU).")
    p.add_argument("--xla-cpu-cores", default=None, metavar="CORES",
                   help="XLA's CPU threads of this process (every case's embedded engine, the fixed XLA program) on "
                        "these cores only, its Python on every core (as `jaxrl-vlm serve --xla-cpu-cores`).")
    ns = p.parse_args(argv)
    if ns.xla_cpu_cores is not None:  # before anything starts jax's backends
        confine_xla_threads(ns.xla_cpu_cores)
    if ("peer" in ns.cases) != bool(ns.peer_url or ns.launch_vllm):
        p.error("the peer case and --peer-url (or --launch-vllm) go together (and --checkpoint: the checkpoint the "
                "peer serves)")
    if "memory" in ns.cases and len(set(ns.contexts)) < 2:
        p.error("the memory case compares how memory grows between contexts: give --contexts at least two lengths")
    peer_repeats = 5 if ns.repeats is None else ns.repeats
    ns.repeats = 2 if ns.repeats is None else ns.repeats

    out: dict[str, Any] = {"size": ns.size, "xla_cpu_cores": ns.xla_cpu_cores}
    if ns.cases == ["memory"]:  # shapes only: no checkpoint, no engine
        return _print_memory(bench_memory(ns.contexts, ns.page_size), ns.json)
    with tempfile.TemporaryDirectory(prefix="bench_engine_") as tmp:
        model_dir = Path(ns.checkpoint) if ns.checkpoint else build_checkpoint(ns.size, Path(tmp))
        from rollout.encoding import ChatEncoder
        from rollout.processing import load_image_processor, load_tokenizer

        encoder = ChatEncoder(load_tokenizer(model_dir), load_image_processor(model_dir))
        if "decode" in ns.cases:
            prompt = encoder.encode_prompt([{"role": "user", "content": "Find the area of the triangle with base 6."}]).wire_ids
            hf = bench_transformers(model_dir, prompt, ns.new_tokens, ns.repeats, ns.torch_threads)
            both = bench_engine(model_dir, prompt, ns.new_tokens, ns.concurrency, ns.repeats,
                                {"slots": None, "paged": ns.page_size}, ns.baseline_checkout)
            rows, slots, other = both["paged"], both["slots"], both.get("checkout")
            out.update(new_tokens=ns.new_tokens, transformers=hf, engine=rows, engine_slots=slots, engine_checkout=other)
        if "multiturn" in ns.cases:
            out["multiturn"] = bench_multiturn(model_dir, encoder, ns.episodes, ns.turns, ns.turn_tokens, ns.repeats)
        if "group" in ns.cases:
            out["group"] = bench_group(model_dir, encoder, ns.group_size, ns.group_prompt_tokens, 8, ns.page_size)
        if "capacity" in ns.cases:
            out["capacity"] = bench_capacity(model_dir, encoder, ns.capacity_episodes, 4, ns.turn_tokens, ns.capacity_memory,
                                             2048, ns.page_size)
        if "weights" in ns.cases:
            out["weights"] = bench_weight_update(model_dir, max(ns.repeats, WEIGHT_PUSHES), Path(tmp))
        if "overlap" in ns.cases:
            prompt = encoder.encode_prompt([{"role": "user", "content": "Find the area of the triangle with base 6."}]).wire_ids
            out["overlap"] = bench_overlap(model_dir, prompt, ns.new_tokens, ns.concurrency, peer_repeats,
                                           ns.repeat_seconds)
        if "prefill" in ns.cases:
            out["prefill"] = bench_prefill(model_dir, ns.prefill_bucket, ns.prefill_rows, ns.repeats)
        if "peer" in ns.cases:
            peer_prompt = encoder.encode_prompt([{"role": "user", "content": "Find the area of the triangle with base 6."}]).wire_ids
            with contextlib.ExitStack() as stack:
                if ns.launch_vllm:
                    ns.peer_url = stack.enter_context(_LaunchedVLLM(ns.launch_vllm, model_dir, Path(tmp) / "vllm.log"))
                out["peer"] = bench_peer(model_dir, encoder, ns.peer_url, peer_prompt, ns.new_tokens, ns.concurrency,
                                         peer_repeats, ns.repeat_seconds, ns.settle_seconds, ns.group_size,
                                         ns.group_prompt_tokens, freeze_gc=not ns.no_freeze_gc)

    if "memory" in ns.cases:
        out["memory"] = bench_memory(ns.contexts, ns.page_size)
        _print_memory(out["memory"], None)
    if "decode" in ns.cases:
        print(f"\nsize={ns.size} prompt={len(prompt)} tokens, {ns.new_tokens} new tokens per request, greedy, EOS ignored")
        print(f"transformers generate (batch 1): {hf['tokens_per_s']:.1f} tok/s")
        print(f"paged: pages of {ns.page_size} tokens; slots (baseline, the engine before paging): one page of max_seq_len "
              f"per request; both attend to a kv bucket of max_seq_len")
        print(f"{'concurrent':>10} {'engine tok/s':>13} {'vs HF':>7} {'steps':>6} {'ms/step':>8} {'warm-up s':>10} {'programs':>9} "
              f"{'slots tok/s':>12} {'paged/slots':>12}")
        for r, b in zip(rows, slots):
            print(f"{r['concurrency']:>10} {r['tokens_per_s']:>13.1f} {r['tokens_per_s'] / hf['tokens_per_s']:>6.2f}x "
                  f"{r['decode_steps']:>6} {r['ms_per_decode_step']:>8.2f} {r['warmup_s']:>10.2f} {r['compiled_programs']:>9} "
                  f"{b['tokens_per_s']:>12.1f} {r['tokens_per_s'] / b['tokens_per_s']:>11.2f}x")
    if "multiturn" in ns.cases:
        mt = out["multiturn"]
        print(f"\nmulti-turn: {ns.episodes} concurrent episodes x {ns.turns} turns, {ns.turn_tokens} new tokens per turn, "
              f"an image in the prompt and every other observation, greedy")
        print(f"{'prefix cache':>12} {'seconds':>8} {'prefilled tok':>14} {'cached tok':>11} {'hits':>5} {'images':>7} "
              f"{'warm-up s':>10} {'programs':>9}")
        for name in ("off", "on"):
            r = mt[name]
            print(f"{name:>12} {r['seconds']:>8.2f} {r['prefilled_tokens']:>14} {r['cached_tokens']:>11} {r['prefix_hits']:>5} "
                  f"{r['encoded_images']:>7} {r['warmup_s']:>10.2f} {r['compiled_programs']:>9}")
        print(f"speed-up with the prefix cache (off / on wall time): {mt['speedup']:.2f}x")
    if "group" in ns.cases:
        g = out["group"]
        print(f"\n(a) GRPO group: {ns.group_size} samples arriving together, prompt {g['on']['prompt_tokens']} tokens with an "
              f"image (pads expanded), pages of {ns.page_size}")
        for name in ("off", "on"):
            r = g[name]
            print(f"  radix cache {name:>3}: prefilled {r['prefilled_tokens']:>6} tokens, cached {r['cached_tokens']:>6}, "
                  f"images encoded {r['encoded_images']}")
        print(f"  prompt tokens prefilled, without / with prefix sharing: {g['ratio']:.2f}x fewer (target >= 5x)")
    if "capacity" in ns.cases:
        c = out["capacity"]
        print(f"\n(b) capacity: {ns.capacity_episodes} concurrent 4-turn episodes ({ns.turn_tokens} new tokens per turn, images), "
              f"KV memory {ns.capacity_memory} tokens, max_seq_len 2048")
        for name in ("slots", "paged"):
            r = c[name]
            print(f"  {name:>5} ({r['pages']} pages of {r['page_size']}): at most {r['max_concurrent']} requests at once, "
                  f"{r['seconds']:.2f} s, prefilled {r['prefilled_tokens']}, cached {r['cached_tokens']}, "
                  f"retractions {r['retractions']}")
        print(f"  concurrent requests within the same memory, paged / slots: {c['ratio']:.2f}x (target >= 3x); "
              f"wall time slots / paged: {c['speedup']:.2f}x")
    if "decode" in ns.cases:
        for i, r in enumerate(rows):
            if r["concurrency"] != 32:
                continue
            print(f"\n(d) decode tok/s at 32 concurrent requests, paged / slots (one max_seq_len page per request): "
                  f"{r['tokens_per_s'] / slots[i]['tokens_per_s']:.2f}x (target >= 1.0x)")
            if other:
                print(f"    paged / the engine of {ns.baseline_checkout} (same options, its own code): "
                      f"{r['tokens_per_s'] / other[i]['tokens_per_s']:.2f}x ({other[i]['tokens_per_s']:.1f} tok/s)")
    if "weights" in ns.cases:
        w = out["weights"]
        print(f"\nweight update, size={ns.size} (fp32), best of {max(ns.repeats, WEIGHT_PUSHES)} pushes each:")
        print(f"  disk (export + /update_weights_from_disk): {w['disk']['seconds']:.4f} s, "
              f"{w['disk']['bytes_written'] / 1e6:.1f} MB written")
        print(f"  memory, copied (the trainer's step donates its parameters): {w['memory']['seconds']:.4f} s "
              f"(disk/copied {w['copy_ratio']:.2f}x)")
        print(f"  memory, shared (the trainer keeps them; the engine serves its arrays): {w['shared']['seconds']:.4f} s")
        print(f"  weights moved alone: disk (export + engine read) {w['move']['disk']:.3f} s, memory (staging, copied) "
              f"{w['move']['memory']:.4f} s, ratio {w['move_ratio']:.2f}")
        print("  (a push also runs pause/flush/update/continue and a version check, in every mode as calls into the "
              "engine in this process, not over HTTP)")
        print(f"RATIO disk/memory weight update: {w['ratio']:.2f}")
    if "overlap" in ns.cases:
        print(f"\noverlapped decode against one step at a time (engine_overlap_schedule on / off), {ns.new_tokens} new "
              f"tokens per request, greedy; {peer_repeats} repeats of at least {ns.repeat_seconds:g} s each, alternated")
        print(f"machine: {out['overlap']['load_before']} before, {out['overlap']['load_after']} after")
        print(f"{'concurrent':>10} {'overlap tok/s (spread)':>24} {'serial tok/s (spread)':>23} {'ratio':>6} "
              f"{'host share overlap / serial':>28}")
        for r in out["overlap"]["rows"]:
            o, q = r["overlap"], r["serial"]
            print(f"{r['concurrency']:>10} {o['median']:>14.0f} ({o['spread']:.2f}x) {q['median']:>13.0f} ({q['spread']:.2f}x) "
                  f"{r['ratio']:>5.2f}x {o['host_share']:>17.0%} / {q['host_share']:.0%}")
        print("RATIO overlap/serial: " + " ".join(f"{r['ratio']:.2f}" for r in out["overlap"]["rows"]))
    if "prefill" in ns.cases:
        pf = out["prefill"]
        print(f"\nprefill: text prompts of the {pf['bucket']}-token bucket, one per forward against side by side "
              f"(median of {ns.repeats * 5} calls each, alternated)")
        print(f"machine: {pf['load_before']} before, {pf['load_after']} after")
        widest = max(r["rows"] for r in pf["rows"])
        print(f"{'prompts':>8} {'one per forward ms':>19} {'side by side ms':>16} {'ratio':>6} "
              f"{f'padded to {widest} rows ms':>22} {'max |dlogprob|':>15}")
        for r in pf["rows"]:
            print(f"{r['rows']:>8} {r['one_ms']:>19.2f} {r['side_ms']:>16.2f} {r['ratio']:>5.2f}x {r['padded_ms']:>22.2f} "
                  f"{r['max_logprob_diff']:>15.1e}")
        print("RATIO one per forward / side by side: " + " ".join(f"{r['ratio']:.2f}" for r in pf["rows"]))
    if "peer" in ns.cases:
        peer = out["peer"]
        print(f"\npeer: the embedded engine against {peer['peer_api']} at {ns.peer_url}, same checkpoint, {ns.new_tokens} "
              f"new tokens per request, greedy, EOS ignored; {peer_repeats} timed repeats per side (rounds back to back "
              f"for at least {ns.repeat_seconds:g} s each, {ns.settle_seconds:g} s idle before each) after a warm-up round, "
              f"A/B alternated")
        print(f"machine: {peer['load_before']} before, {peer['load_after']} after; XLA's CPU threads (this process): "
              f"{'cores ' + ns.xla_cpu_cores if ns.xla_cpu_cores else 'every core'}")
        print(f"{'concurrent':>10} {'embedded tok/s: median (min-max) spread':>42} {'peer tok/s: median (min-max) spread':>38} "
              f"{'ratio':>6} {'host':>5} {'overlap':>7} {'ms/step':>8} {'compiles':>8} {'gc s (max)':>11} {'machine py/xla':>14} "
              f"{'round spreads':>14} {'program ms/step spread':>23} {'steps/round':>12}")
        for r in peer["decode"]:
            e, v, gc = r["embedded"], r["peer"], r["gc"]
            compiles = f"{r['compilations']}+{r['background_compilations']}"
            print(f"{r['concurrency']:>10} {e['median']:>14.0f} ({e['min']:>6.0f}-{e['max']:<6.0f}) {e['spread']:>6.2f}x "
                  f"{v['median']:>12.0f} ({v['min']:>6.0f}-{v['max']:<6.0f}) {v['spread']:>6.2f}x {r['ratio']:>5.2f}x "
                  f"{r['host_share']:>5.0%} {r['overlapped_share']:>7.0%} {r['ms_per_decode_step']:>8.2f} {compiles:>8} "
                  f"{gc['total_s']:>5.3f} ({gc['longest_s']:.3f}) {r['machine']['spread']:>7.2f}x/{r['machine_xla']['spread']:.2f}x "
                  f"{r['rounds']['embedded']['spread']:>6.2f}x/{r['rounds']['peer']['spread']:.2f}x "
                  f"{r['program_ms_per_step']['median']:>13.2f} ({r['program_ms_per_step']['spread']:.2f}x) "
                  f"{r['steps_per_round']['min']:>5.1f}-{r['steps_per_round']['max']:.1f}")
        print("compiles: compilations during the timed repeats on the threads that serve requests (each stalls them) + "
              "on the engine's side thread (a decode or prefill bucket in steady use; stalls nothing)")
        print("gc s (max): the garbage collector's pauses in this process (the embedded engine's) during the timed "
              "repeats, total and longest; machine py/xla: the spread of one fixed piece of Python work (one core) and of "
              "one fixed XLA program (XLA's threads, as the decode program runs), each as long as a repeat, timed "
              "after each A/B pair (floors under both sides' spreads); round spreads: the spread of single "
              "rounds (embedded/peer); program ms/step: the embedded engine's time inside its decode program per step "
              "(median over repeats, and its spread), steps/round: its decode steps per round (min-max over repeats), "
              "the work its schedule did")
        print("repeats in the order they ran, tok/s, embedded | peer (the sides alternate, so a drift both share is "
              "the machine's):")
        for r in peer["decode"]:
            print(f"{r['concurrency']:>10}  " + " ".join(f"{x:.0f}" for x in r["embedded"]["runs"]) + "  |  "
                  + " ".join(f"{x:.0f}" for x in r["peer"]["runs"]))
        g = peer["group"]
        print(f"GRPO group of {ns.group_size} on one image prompt ({g['embedded']['prompt_tokens']} tokens): prompt tokens "
              f"prefilled, embedded {g['embedded']['prefilled']}, peer {g['peer']['prefilled']} (peer / embedded "
              f"{g['ratio']:.2f}x)")
    if ns.json:
        Path(ns.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
