"""Decode throughput of the embedded engine against transformers' `generate` (batch 1), and multi-turn
episodes with the prefix cache on against off, in one run.

    python scripts/bench_engine.py [--size tiny|small] [--new-tokens 64] [--concurrency 1 8 32]
                                   [--cases decode multiturn] [--episodes 8] [--turns 4]

Builds a random Qwen3-VL checkpoint of the chosen size (transformers, saved with `save_pretrained`,
with the tiny tokenizer and processor files), then measures on the same machine and prompt:

* transformers: greedy `generate` of N new tokens at batch 1 (EOS ignored), tokens / wall time;
* the engine: C concurrent `/generate` requests over loopback HTTP (SGLangClient), N new tokens each
  (EOS ignored), total tokens / wall time, after an untimed warm-up round that compiles the programs.

Both timings include the prompt's prefill (short next to N tokens). Printed: tokens/s, ratio to
transformers, decode steps per token and the compiled-program count (compile time and host
overhead are reported, not hidden).

Multi-turn case: E concurrent episodes of T turns each, as the rollout runs them: the first prompt
has a long text and an image, every turn generates N tokens and appends an observation (a new image
every other turn), and the next request re-sends the whole conversation. Timed on two engines that
differ only in `prefix_cache`, after an untimed warm-up episode set and a cache flush: wall time,
prefilled and cached prompt tokens, vision-tower images, and the off/on time ratio.

Weight-update case (issue 18 (c)): a trainer-side copy of the model in this process pushes new weights to the
embedded engine, alternately through the disk (versioned HF export + /update_weights_from_disk) and in memory
(`--weight-sync-mode memory`: device to device, the same pause/flush/update/continue sequence and version
check), after one untimed push of each: seconds per push and the disk/memory ratio. Run it with `--size small`.
`--json FILE` also writes the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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


async def _round(url: str, prompt: list[int], concurrency: int, new_tokens: int) -> tuple[int, float]:
    from rollout.client import SGLangClient

    params = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    async with SGLangClient(url, timeout_s=600) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(client.generate(prompt, sampling_params=params) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return sum(len(r.output_ids) for r in results), elapsed


def bench_engine(model_dir: Path, prompt: list[int], new_tokens: int, concurrencies: list[int], repeats: int) -> list[dict[str, Any]]:
    from jaxrl_vlm.engine import EmbeddedEngine, EngineOptions

    max_batch = max(concurrencies)
    config = EngineOptions(max_batch=max_batch, max_seq_len=max(256, len(prompt) + new_tokens + 1), min_kv_bucket=128)
    rows = []
    with EmbeddedEngine(str(model_dir), config=config) as engine:
        for c in concurrencies:
            compile_start = time.perf_counter()
            asyncio.run(_round(engine.url, prompt, c, new_tokens))  # compiles this concurrency's programs
            warmup_s = time.perf_counter() - compile_start
            best, tokens, steps = float("inf"), 0, 0
            for _ in range(repeats):
                before = engine.stats.decode_steps
                tokens, elapsed = asyncio.run(_round(engine.url, prompt, c, new_tokens))
                if elapsed < best:
                    best, steps = elapsed, engine.stats.decode_steps - before
            rows.append({"concurrency": c, "tokens": tokens, "seconds": best, "tokens_per_s": tokens / best,
                         "decode_steps": steps, "ms_per_decode_step": 1e3 * best / max(1, steps), "warmup_s": warmup_s,
                         "compiled_programs": engine.engine.runner.num_programs})
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
                                              mode=mode) for mode in ("disk", "memory")}
                times: dict[str, list[float]] = {"disk": [], "memory": []}
                version = 0
                for rep in range(repeats + 1):
                    for mode, syncer in syncers.items():
                        version += 1
                        t0 = time.perf_counter()
                        report = await syncer.push(trainer_model, version)
                        if rep:  # the first push of each compiles nothing but warms caches: untimed
                            times[mode].append(time.perf_counter() - t0)
                        assert report.in_memory == (mode == "memory")
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
    out["ratio"] = out["disk"]["seconds"] / out["memory"]["seconds"]
    out["move"] = {mode: min(t) for mode, t in moves.items()}
    out["move_ratio"] = out["move"]["disk"] / out["move"]["memory"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--torch-threads", type=int, default=max(1, os.cpu_count() or 1))
    p.add_argument("--cases", nargs="+", choices=("decode", "multiturn", "weights"), default=["decode", "multiturn"])
    p.add_argument("--episodes", type=int, default=8, help="Concurrent episodes of the multi-turn case.")
    p.add_argument("--turns", type=int, default=4, help="Turns per episode of the multi-turn case.")
    p.add_argument("--turn-tokens", type=int, default=32, help="New tokens per turn of the multi-turn case.")
    p.add_argument("--json", default=None, help="Also write the results to this file.")
    ns = p.parse_args(argv)

    out: dict[str, Any] = {"size": ns.size}
    with tempfile.TemporaryDirectory(prefix="bench_engine_") as tmp:
        model_dir = build_checkpoint(ns.size, Path(tmp))
        from rollout.encoding import ChatEncoder
        from rollout.processing import load_image_processor, load_tokenizer

        encoder = ChatEncoder(load_tokenizer(model_dir), load_image_processor(model_dir))
        if "decode" in ns.cases:
            prompt = encoder.encode_prompt([{"role": "user", "content": "Find the area of the triangle with base 6."}]).wire_ids
            hf = bench_transformers(model_dir, prompt, ns.new_tokens, ns.repeats, ns.torch_threads)
            rows = bench_engine(model_dir, prompt, ns.new_tokens, ns.concurrency, ns.repeats)
            out.update(new_tokens=ns.new_tokens, transformers=hf, engine=rows)
        if "multiturn" in ns.cases:
            out["multiturn"] = bench_multiturn(model_dir, encoder, ns.episodes, ns.turns, ns.turn_tokens, ns.repeats)
        if "weights" in ns.cases:
            out["weights"] = bench_weight_update(model_dir, max(ns.repeats, 3), Path(tmp))

    if "decode" in ns.cases:
        print(f"\nsize={ns.size} prompt={len(prompt)} tokens, {ns.new_tokens} new tokens per request, greedy, EOS ignored")
        print(f"transformers generate (batch 1): {hf['tokens_per_s']:.1f} tok/s")
        print(f"{'concurrent':>10} {'engine tok/s':>13} {'vs HF':>7} {'steps':>6} {'ms/step':>8} {'warm-up s':>10} {'programs':>9}")
        for r in rows:
            print(f"{r['concurrency']:>10} {r['tokens_per_s']:>13.1f} {r['tokens_per_s'] / hf['tokens_per_s']:>6.2f}x "
                  f"{r['decode_steps']:>6} {r['ms_per_decode_step']:>8.2f} {r['warmup_s']:>10.2f} {r['compiled_programs']:>9}")
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
    if "weights" in ns.cases:
        w = out["weights"]
        print(f"\nweight update, size={ns.size} (fp32), best of {max(ns.repeats, 3)} pushes each:")
        print(f"  disk (export + /update_weights_from_disk): {w['disk']['seconds']:.3f} s, "
              f"{w['disk']['bytes_written'] / 1e6:.1f} MB written")
        print(f"  memory (device to device, same update sequence): {w['memory']['seconds']:.3f} s")
        print(f"  weights moved alone: disk (export + engine read) {w['move']['disk']:.3f} s, memory (staging) "
              f"{w['move']['memory']:.4f} s, ratio {w['move_ratio']:.2f}")
        print("  (a push also runs pause/flush/update/continue and a version check over HTTP in both modes)")
        print(f"RATIO disk/memory weight update: {w['ratio']:.2f}")
    if ns.json:
        Path(ns.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
