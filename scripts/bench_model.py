"""Forward+backward tokens/s: our jitted Flax Qwen3-VL vs transformers' PyTorch Qwen3-VL, in one run.

Both run the same small config with the same weights (ours exported with `to_hf`, loaded by
`from_pretrained`) on the same batch: B rows of T tokens, each row with one image of `--image-grid`
patches (its pads expanded), loss = mean next-token cross-entropy, gradients of every parameter
materialised. Iterations alternate between the two frameworks so machine load (other processes on
a shared CPU) hits both alike; warm-up (and JAX's compile) is excluded; medians are reported.

    .venv/bin/python scripts/bench_model.py                  # fp32 (+ our bf16 compute as an extra row)
    .venv/bin/python scripts/bench_model.py --iters 20 --seq 512

The printed ratio is ours / PyTorch tokens/s (the target is >= 1.5 on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def small_config(args: argparse.Namespace):
    from jaxrl_vlm.models.config import Qwen3VLConfig, TextConfig, VisionConfig

    head_dim = args.hidden // args.heads
    hw = (head_dim // 2) * 20 // 64  # Qwen3-VL's [24, 20, 20] proportions of the rotary half
    return Qwen3VLConfig(
        text=TextConfig(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            intermediate_size=args.hidden * 3,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=max(1, args.heads // 2),
            head_dim=head_dim,
            mrope_section=(head_dim // 2 - 2 * hw, hw, hw),
        ),
        vision=VisionConfig(
            depth=2,
            hidden_size=args.hidden // 2,
            intermediate_size=args.hidden,
            num_heads=2,
            out_hidden_size=args.hidden,
            num_position_embeddings=64,
            deepstack_visual_indexes=(0, 1),
        ),
        image_token_id=args.vocab - 4,
        video_token_id=args.vocab - 3,
        vision_start_token_id=args.vocab - 2,
        vision_end_token_id=args.vocab - 1,
        bos_token_id=None,
        eos_token_id=None,
    )


def make_batch(cfg, args: argparse.Namespace, seed: int = 0) -> dict[str, np.ndarray]:
    """tokens [B, T] with one image per row (vision_start, pads, vision_end), random patches."""
    rng = np.random.default_rng(seed)
    b, t = args.batch, args.seq
    g = args.image_grid
    tokens = rng.integers(0, cfg.text.vocab_size - 4, size=(b, t)).astype(np.int64)
    grids = np.zeros((0, 3), np.int64)
    pixels = np.zeros((0, cfg.vision.patch_dim), np.float32)
    if g:
        n_pads = g * g // cfg.vision.merge_unit
        if n_pads + 8 > t:
            raise SystemExit(f"--seq {t} is too short for an image of {n_pads} tokens")
        for row in range(b):
            start = 4 + row % 3
            tokens[row, start] = cfg.vision_start_token_id
            tokens[row, start + 1 : start + 1 + n_pads] = cfg.image_token_id
            tokens[row, start + 1 + n_pads] = cfg.vision_end_token_id
        grids = np.tile(np.array([[1, g, g]], np.int64), (b, 1))
        pixels = rng.standard_normal((b * g * g, cfg.vision.patch_dim)).astype(np.float32)
    return {"tokens": tokens, "grid": grids, "pixels": pixels}


def build_ours(model, batch: dict[str, np.ndarray]):
    """A jitted `(state) -> (loss, grads)` closure over the batch, and the param state."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxrl_vlm.models import build_vision_inputs, get_rope_index, token_logprobs

    cfg = model.cfg
    tokens = batch["tokens"].astype(np.int32)
    inputs_np, targets = tokens[:, :-1], jnp.asarray(tokens[:, 1:])
    mask = np.ones_like(inputs_np)
    grid = batch["grid"] if len(batch["grid"]) else None
    positions, _ = get_rope_index(inputs_np, grid, mask, cfg)
    vision = None
    if grid is not None:  # image slots index the flat [B, T-1] input batch
        vision = jax.tree.map(jnp.asarray, build_vision_inputs(batch["pixels"], grid, inputs_np, cfg))
    inputs = jnp.asarray(inputs_np), jnp.asarray(positions), jnp.asarray(mask)
    graphdef, state = nnx.split(model, nnx.Param)

    def loss_fn(state):
        m = nnx.merge(graphdef, state)
        hidden = m(*inputs, vision) if vision is not None else m(*inputs)
        lp, _ = token_logprobs(m, hidden, targets, chunk_size=512)
        return -jnp.mean(lp)

    step = jax.jit(jax.value_and_grad(loss_fn))
    return step, state


def build_torch(path: Path, batch: dict[str, np.ndarray], cfg):
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    tokens = torch.from_numpy(batch["tokens"])
    kwargs = dict(
        input_ids=tokens[:, :-1],
        attention_mask=torch.ones_like(tokens[:, :-1]),
        mm_token_type_ids=(tokens[:, :-1] == cfg.image_token_id).long(),
    )
    if len(batch["grid"]):
        kwargs["pixel_values"] = torch.from_numpy(batch["pixels"])
        kwargs["image_grid_thw"] = torch.from_numpy(batch["grid"])
    targets = tokens[:, 1:]

    def step() -> float:
        model.zero_grad(set_to_none=True)
        logits = model(**kwargs).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        return float(loss.detach())

    return step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=257, help="Tokens per row (inputs are seq-1, next-token targets).")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--image-grid", type=int, default=8, help="Patches per side of each row's image (0: text only).")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-bf16", action="store_true", help="Skip the extra row with our bf16 compute.")
    parser.add_argument("--json", default=None, help="Also write the results here.")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import torch

    from jaxrl_vlm.models import to_hf
    from jaxrl_vlm.models.hf_io import param_count
    from jaxrl_vlm.tiny import init_tiny_model

    cfg = small_config(args)
    batch = make_batch(cfg, args)
    variants = ["float32"] + ([] if args.no_bf16 else ["bfloat16"])
    with tempfile.TemporaryDirectory() as tmp:
        model = init_tiny_model(cfg, seed=0)
        to_hf(model, tmp, dtype=jnp.float32)
        torch_step = build_torch(Path(tmp), batch, cfg)
        ours = {}
        for v in variants:
            ours[v] = build_ours(init_tiny_model(cfg, seed=0, compute_dtype=jnp.dtype(v)), batch)

    tokens_per_step = args.batch * (args.seq - 1)
    compile_s = {}
    losses = {}
    for v, (step, state) in ours.items():
        t0 = time.perf_counter()
        loss, grads = step(state)
        jax.block_until_ready(grads)
        compile_s[v] = time.perf_counter() - t0
        losses[v] = float(loss)
    losses["torch"] = torch_step()
    for _ in range(args.warmup):
        torch_step()
        for step, state in ours.values():
            jax.block_until_ready(step(state))

    times: dict[str, list[float]] = {k: [] for k in ["torch", *variants]}
    for _ in range(args.iters):
        t0 = time.perf_counter()
        torch_step()
        times["torch"].append(time.perf_counter() - t0)
        for v, (step, state) in ours.items():
            t0 = time.perf_counter()
            jax.block_until_ready(step(state))
            times[v].append(time.perf_counter() - t0)

    med = {k: statistics.median(v) for k, v in times.items()}
    tps = {k: tokens_per_step / s for k, s in med.items()}
    print(f"config: {param_count(cfg):,} params, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; "
          f"batch {args.batch} x {args.seq - 1} tokens, image {args.image_grid}x{args.image_grid} patches per row")
    print(f"cpu threads: torch {torch.get_num_threads()}, os {os.cpu_count()}; jax {jax.__version__}, torch {torch.__version__}")
    same = abs(losses["float32"] - losses["torch"]) < 1e-3
    print(f"loss check (same weights, same batch): ours fp32 {losses['float32']:.5f}  torch {losses['torch']:.5f}  "
          f"{'OK' if same else 'MISMATCH: the two programs do not compute the same thing'}")
    print(f"{'framework':<26}{'median s/step':>14}{'tokens/s':>12}{'vs torch':>10}{'compile s':>11}")
    print(f"{'transformers (torch eager)':<26}{med['torch']:>14.4f}{tps['torch']:>12.0f}{1.0:>10.2f}{'-':>11}")
    for v in variants:
        name = f"ours jit ({'fp32' if v == 'float32' else 'bf16 compute'})"
        print(f"{name:<26}{med[v]:>14.4f}{tps[v]:>12.0f}{tps[v] / tps['torch']:>10.2f}{compile_s[v]:>11.1f}")
    ratio = tps["float32"] / tps["torch"]
    print(f"RATIO ours/torch (fp32, fwd+bwd tokens/s): {ratio:.2f}  (target >= 1.5: {'met' if ratio >= 1.5 else 'NOT met'})")
    if args.json:
        Path(args.json).write_text(json.dumps({"median_s": med, "tokens_per_s": tps, "ratio": ratio, "losses": losses,
                                               "compile_s": compile_s, "args": vars(args)}, indent=2))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
