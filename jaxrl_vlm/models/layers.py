"""The shared layers of the Qwen-VL families, in plain Flax NNX: what a family file builds its model from.

Semantics follow transformers' `modeling_qwen3_vl.py` / `modeling_qwen2_5_vl.py`; layouts are ours
(einsum-friendly, shapes in names). Here: parameters with logical axis names, norms, rotary embeddings
(M-RoPE, 2-D vision rotary), grouped-query attention (dense, chunked-local, or the fused kernels of
`flash_attention.py`) and its masks, the text decoder layer (attention with q/k norm or q/k/v bias, as the
config says; SwiGLU MLP), the ViT attention and the patch merger, and `VisionLanguageDecoder`: embedding,
decoder layers, final norm and LM head, with a family's vision tower writing merged image tokens at the
image-pad slots. A family (`qwen3_vl.py`, `qwen2_5_vl.py`, `qwen3_5.py`) adds its vision tower and registers
itself (`families.py`); no family imports another's helpers. `LearnedPositionVisionTower` is Qwen3-VL's tower as a
shared layer (Qwen3.5 uses it without deepstack).

Every parameter carries logical axis names (`out_sharding` metadata, not applied eagerly), so
`nnx.get_partition_spec(nnx.state(model))` yields them; `jaxrl_vlm.sharding.rules` maps them to mesh axes.

Logical axis names:
  vocab, embed, mlp, heads, kv_heads, head_dim, norm (every norm scale/bias vector),
  vision_patch (flattened C*T*p*p patch), vision_pos (learned position table rows),
  vision_embed, vision_heads, vision_head_dim, vision_mlp, vision_merge (merger input = 4 * vision_embed).

Inputs are fixed-shape host-prepared arrays (see `rope.py`, `vision.py`):
  tokens [B, T] int32, positions [3, B, T] int32 (M-RoPE t/h/w), segment_ids [B, T] int32
  (0 = padding, k > 0 = k-th sequence packed in the row; attention is causal AND same-segment),
  and optional vision inputs (`VisionInputs` or a family's own) for all images of the batch.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jaxrl_vlm.models.activation_sharding import (
    PATCH_HEADS,
    PATCH_HEADS_WHOLE,
    PATCH_HIDDEN,
    PATCH_LOGITS,
    PATCH_MLP,
    KV_WHOLE,
    ROWS_HIDDEN,
    ROWS_KV,
    ROWS_MLP,
    ROWS_Q,
    ROWS_ROPE,
    ROWS_VOCAB,
    TEXT_LOGITS,
    TEXT_MASK,
    constrain,
)
from jaxrl_vlm.models.config import ATTENTION_IMPLS, ModelConfig, VisionConfig
from jaxrl_vlm.models.families import PolicyModel
from jaxrl_vlm.models.flash_attention import IMPLS as FUSED_IMPLS, flash_attention
from jaxrl_vlm.models.remat import POLICIES, RematPlan
from jaxrl_vlm.models.ring_attention import ring_attention
from jaxrl_vlm.models.rope import mrope_frequency_axis, rope_inv_freq

_NEG_INF = float(np.finfo(np.float32).min)


def param(
    rngs: nnx.Rngs | None,
    shape: Sequence[int],
    names: tuple[str, ...],
    dtype: jnp.dtype,
    init: str = "normal",
    std: float = 0.02,
) -> nnx.Param:
    """A parameter with logical axis names; `init` is normal(std) / ones / zeros (HF-like)."""
    if len(names) != len(shape):
        raise ValueError(f"axis names {names} do not match shape {tuple(shape)}")
    if init == "normal":
        value = std * jax.random.normal(rngs.params(), tuple(shape), jnp.float32)
    elif init == "ones":
        value = jnp.ones(tuple(shape), jnp.float32)
    elif init == "zeros":
        value = jnp.zeros(tuple(shape), jnp.float32)
    else:
        raise ValueError(f"unknown init {init!r}")
    return nnx.Param(value.astype(dtype), out_sharding=names, eager_sharding=False)


def activation(name: str) -> Callable[[jax.Array], jax.Array]:
    if name == "silu":
        return jax.nn.silu
    if name == "gelu_pytorch_tanh":
        return lambda x: jax.nn.gelu(x, approximate=True)
    if name == "gelu":
        return lambda x: jax.nn.gelu(x, approximate=False)
    if name == "quick_gelu":
        return lambda x: x * jax.nn.sigmoid(1.702 * x)
    raise ValueError(f"unsupported activation {name!r}")


def rotate_half(x: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [..., heads, head_dim]; cos/sin broadcastable [..., 1, head_dim] (half-split layout)."""
    return x * cos + rotate_half(x) * sin


def mrope_cos_sin(positions_3bt: jax.Array, cfg: ModelConfig, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """M-RoPE tables cos, sin [B, T, head_dim] from host positions [3, B, T] (interleaved or contiguous
    sections, per `cfg.text.mrope_interleaved`; see `rope.mrope_frequency_axis`)."""
    inv_freq = jnp.asarray(rope_inv_freq(cfg.text.head_dim, cfg.text.rope_theta))  # [H/2]
    axis = jnp.asarray(mrope_frequency_axis(cfg))  # [H/2] in {0,1,2}
    pos = jnp.take(positions_3bt.astype(jnp.float32), axis, axis=0)  # [H/2, B, T]
    angles = jnp.moveaxis(pos, 0, -1) * inv_freq  # [B, T, H/2]
    emb = constrain(jnp.concatenate([angles, angles], axis=-1), ROWS_ROPE)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    scale: float,
    logits_names: tuple[str | None, ...] | None = None,
) -> jax.Array:
    """Grouped-query softmax attention (XLA einsums, softmax in fp32).

    q [B, Tq, N, H], k/v [B, Tk, K, H] with N = K * G (query head n uses kv head n // G),
    mask bool [B, Tq, Tk] (True = may attend). Returns [B, Tq, N, H] in q's dtype.
    `logits_names`: logical names of the [B, K, G, Tq, Tk] logits, to pin their sharding (see `constrain`).
    """
    b, tq, n, h = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, tq, kv, n // kv, h)
    logits = jnp.einsum("bqkgh,bskh->bkgqs", qg, k, preferred_element_type=jnp.float32) * scale
    logits = jnp.where(mask[:, None, None], logits, _NEG_INF)
    if logits_names is not None:
        logits = constrain(logits, logits_names)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskh->bqkgh", probs, v)
    return out.reshape(b, tq, n, h)


def local_segment_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, block: int,
                            scale: float) -> jax.Array:
    """Bidirectional attention among equal segment ids, when every segment is one contiguous run of at most
    `block` positions: the same result as the dense masked `attention`, at O(P * 3 block) instead of O(P^2).

    q [P, N, H], k/v [P, K, H], segment_ids [P] (-1 = padding). The positions are cut into chunks of `block`;
    a run of <= block positions lies within two neighbouring chunks, so the queries of chunk i see all of their
    segment among the keys of chunks i-1, i and i+1. A packed micro-batch of many small images (each image
    attends only to itself) stops paying for every pair of patches in the batch. Padding rows (-1) attend to
    the padding near them rather than to all padding; their outputs are never used. Returns [P, N, H].
    """
    p = q.shape[0]
    c = -(-p // block)

    def chunks(x: jax.Array, fill: int) -> jax.Array:  # [P, ...] -> [c, block, ...]
        x = jnp.pad(x, [(0, c * block - p)] + [(0, 0)] * (x.ndim - 1), constant_values=fill)
        return x.reshape(c, block, *x.shape[1:])

    def windows(x: jax.Array, fill: int) -> jax.Array:  # [P, ...] -> [c, 3 block, ...]: chunks i-1, i, i+1
        xc = chunks(x, fill)
        edge = jnp.full((1,) + xc.shape[1:], fill, xc.dtype)
        xp = jnp.concatenate([edge, xc, edge], axis=0)
        return jnp.concatenate([xp[:-2], xp[1:-1], xp[2:]], axis=1)

    # Every query row matches at least its own key (padding included), so no softmax row is empty.
    mask = chunks(segment_ids, -1)[:, :, None] == windows(segment_ids, -1)[:, None, :]
    out = attention(chunks(q, 0), windows(k, 0), windows(v, 0), mask, scale)
    return out.reshape(c * block, *out.shape[2:])[:p]


def text_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: "AttentionMask", scale: float) -> jax.Array:
    """Causal, segment-aware attention of a decoder layer: q [B, T, N, H], k/v [B, T, K, H] -> [B, T, N, H].

    Under context parallelism (the `sequence` activations split over a `context` mesh axis) each device keeps its
    contiguous block of queries and gathers the row's keys and values (`KV_WHOLE`): one all-gather of K/V per
    layer, and the [Tq/cp, T] logits and mask of its block. The causal mask uses global positions, so a block
    attends to every earlier block and packing segments may cross block boundaries. Work is balanced without a
    zig-zag order because the XLA attention computes every (query, key) pair of its block, masked or not. The
    fused kernels (`pallas_gpu`, `pallas_tpu`) run inside a `shard_map` (see `flash_attention`) on query chunks at
    their row offsets, skipping key blocks after them, in zig-zag chunk order so every device does equal causal
    work (`pallas_gpu`: our query-offset kernel; `pallas_tpu`: jax's Splash kernel per static offset). `ring`
    (`ring_attention`) keeps each device's queries and passes the keys and values around the context group instead
    of gathering them (no dense mask, no [Tq/cp, T] logits), also in zig-zag order.
    """
    if mask.impl == "ring":
        return ring_attention(q, k, v, mask.segment_ids, scale=scale)
    if mask.dense is None:
        return flash_attention(q, k, v, mask.segment_ids, impl=mask.impl, scale=scale, causal=True)
    k, v = constrain(k, KV_WHOLE), constrain(v, KV_WHOLE)
    return attention(q, k, v, mask.dense, scale, logits_names=TEXT_LOGITS)


@struct.dataclass
class AttentionMask:
    """Who may attend to whom, and with which implementation (static). `segment_ids` always ([B, T] text
    rows, [P] patches); `dense` ([B, T, T] / [P, P] bool) only for the dense XLA attention — a fused kernel
    derives the mask from the segment ids tile by tile. `block` (patches, XLA only): segments are contiguous
    runs of at most `block` positions, attended chunk by chunk (`local_segment_attention`)."""

    segment_ids: jax.Array
    dense: jax.Array | None
    impl: str = struct.field(pytree_node=False, default="xla")
    block: int | None = struct.field(pytree_node=False, default=None)


def text_mask(segment_ids_bt: jax.Array, attention_impl: str) -> AttentionMask:
    """Causal AND same-segment attention for packed rows (a dense [B, T, T] mask only for the XLA attention; the
    fused kernels and ring attention mask tile by tile from the segment ids and positions)."""
    if attention_impl != "xla":
        return AttentionMask(segment_ids_bt, None, attention_impl)
    idx = jnp.arange(segment_ids_bt.shape[1])
    same = segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :]
    return AttentionMask(segment_ids_bt, constrain(same & (idx[:, None] >= idx[None, :])[None], TEXT_MASK))


def patch_mask(segment_ids_p: jax.Array, attention_impl: str, block: int | None = None) -> AttentionMask:
    """Bidirectional attention within one image frame (or window). `block`: no frame has more patches than
    this (the image processor's cap); the XLA attention then works chunk by chunk when that is cheaper. Only the
    fused kernels have a patch attention of their own: any other impl (`ring` is causal text attention) uses XLA's."""
    if attention_impl in FUSED_IMPLS:
        return AttentionMask(segment_ids_p, None, attention_impl)
    if block is not None and 3 * block < segment_ids_p.shape[0]:
        return AttentionMask(segment_ids_p, None, "xla", block)
    return AttentionMask(segment_ids_p, segment_ids_p[:, None] == segment_ids_p[None, :])


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis; statistics in fp32 (as transformers)."""

    def __init__(self, dim: int, eps: float, *, param_dtype: jnp.dtype):
        self.eps = eps
        self.scale = param(None, (dim,), ("norm",), param_dtype, init="ones")

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(x.dtype) * normed.astype(x.dtype)


class LayerNorm(nnx.Module):
    """LayerNorm with bias over the last axis (eps 1e-6 in Qwen3-VL's vision tower); fp32 statistics."""

    def __init__(self, dim: int, *, param_dtype: jnp.dtype, eps: float = 1e-6):
        self.eps = eps
        self.scale = param(None, (dim,), ("norm",), param_dtype, init="ones")
        self.bias = param(None, (dim,), ("norm",), param_dtype, init="zeros")

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        y = y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)


# ----------------------------------------------------------------------------- text decoder


class TextAttention(nnx.Module):
    """GQA self-attention with M-RoPE: per-head q/k RMSNorm before it (Qwen3, `text.qk_norm`) or q/k/v
    projection biases (Qwen2, `text.attention_bias`). Factored so a KV-cache decode path can call
    `project` and `output` separately."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, param_dtype: jnp.dtype, compute_dtype: jnp.dtype):
        t = cfg.text
        d, n, kv, h = t.hidden_size, t.num_attention_heads, t.num_key_value_heads, t.head_dim
        self.compute_dtype = compute_dtype
        self.scale = h**-0.5
        self.q_kernel_dnh = param(rngs, (d, n, h), ("embed", "heads", "head_dim"), param_dtype)
        self.k_kernel_dkh = param(rngs, (d, kv, h), ("embed", "kv_heads", "head_dim"), param_dtype)
        self.v_kernel_dkh = param(rngs, (d, kv, h), ("embed", "kv_heads", "head_dim"), param_dtype)
        self.o_kernel_nhd = param(rngs, (n, h, d), ("heads", "head_dim", "embed"), param_dtype)
        self.has_bias = t.attention_bias
        if t.attention_bias:
            self.q_bias_nh = param(None, (n, h), ("heads", "head_dim"), param_dtype, init="zeros")
            self.k_bias_kh = param(None, (kv, h), ("kv_heads", "head_dim"), param_dtype, init="zeros")
            self.v_bias_kh = param(None, (kv, h), ("kv_heads", "head_dim"), param_dtype, init="zeros")
        self.has_qk_norm = t.qk_norm
        if t.qk_norm:
            self.q_norm = RMSNorm(h, t.rms_norm_eps, param_dtype=param_dtype)
            self.k_norm = RMSNorm(h, t.rms_norm_eps, param_dtype=param_dtype)

    def project(self, x_btd: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, T, D] -> roped q [B, T, N, H], roped k [B, T, K, H], v [B, T, K, H]."""
        cd = self.compute_dtype
        x = x_btd.astype(cd)
        q = constrain(jnp.einsum("btd,dnh->btnh", x, self.q_kernel_dnh[...].astype(cd)), ROWS_Q)
        k = constrain(jnp.einsum("btd,dkh->btkh", x, self.k_kernel_dkh[...].astype(cd)), ROWS_KV)
        v = constrain(jnp.einsum("btd,dkh->btkh", x, self.v_kernel_dkh[...].astype(cd)), ROWS_KV)
        if self.has_bias:
            q = q + self.q_bias_nh[...].astype(cd)
            k = k + self.k_bias_kh[...].astype(cd)
            v = v + self.v_bias_kh[...].astype(cd)
        if self.has_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def output(self, o_btnh: jax.Array) -> jax.Array:
        cd = self.compute_dtype
        o = constrain(o_btnh.astype(cd), ROWS_Q)
        return constrain(jnp.einsum("btnh,nhd->btd", o, self.o_kernel_nhd[...].astype(cd)), ROWS_HIDDEN)

    def __call__(self, x_btd: jax.Array, cos: jax.Array, sin: jax.Array, mask: AttentionMask) -> jax.Array:
        q, k, v = self.project(x_btd, cos, sin)
        return self.output(text_attention(q, k, v, mask, self.scale))


class TextMLP(nnx.Module):
    """SwiGLU: down(silu(gate x) * up x)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, param_dtype: jnp.dtype, compute_dtype: jnp.dtype):
        d, f = cfg.text.hidden_size, cfg.text.intermediate_size
        self.compute_dtype = compute_dtype
        self.act_name = cfg.text.hidden_act
        self.gate_kernel_df = param(rngs, (d, f), ("embed", "mlp"), param_dtype)
        self.up_kernel_df = param(rngs, (d, f), ("embed", "mlp"), param_dtype)
        self.down_kernel_fd = param(rngs, (f, d), ("mlp", "embed"), param_dtype)

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        cd = self.compute_dtype
        x = x_btd.astype(cd)
        gate = constrain(jnp.einsum("btd,df->btf", x, self.gate_kernel_df[...].astype(cd)), ROWS_MLP)
        up = constrain(jnp.einsum("btd,df->btf", x, self.up_kernel_df[...].astype(cd)), ROWS_MLP)
        hidden = activation(self.act_name)(gate) * up
        return constrain(jnp.einsum("btf,fd->btd", hidden, self.down_kernel_fd[...].astype(cd)), ROWS_HIDDEN)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, param_dtype: jnp.dtype, compute_dtype: jnp.dtype):
        eps = cfg.text.rms_norm_eps
        self.input_norm = RMSNorm(cfg.text.hidden_size, eps, param_dtype=param_dtype)
        self.attn = TextAttention(cfg, rngs=rngs, param_dtype=param_dtype, compute_dtype=compute_dtype)
        self.post_attn_norm = RMSNorm(cfg.text.hidden_size, eps, param_dtype=param_dtype)
        self.mlp = TextMLP(cfg, rngs=rngs, param_dtype=param_dtype, compute_dtype=compute_dtype)

    def __call__(self, x_btd: jax.Array, cos: jax.Array, sin: jax.Array, mask: AttentionMask) -> jax.Array:
        x_btd = constrain(x_btd, ROWS_HIDDEN)
        x = x_btd + self.attn(self.input_norm(x_btd), cos, sin, mask)
        return constrain(x + self.mlp(self.post_attn_norm(x)), ROWS_HIDDEN)


def run_layer(layer: DecoderLayer, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: AttentionMask) -> jax.Array:
    return layer(x, cos, sin, mask)


def run_block(block: nnx.Module, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: AttentionMask) -> jax.Array:
    return block(x, cos, sin, mask)


def checkpoint_policy(policy: str) -> Callable[..., bool] | None:
    """The jax checkpoint policy of a `remat.POLICIES` name other than none (None: save nothing, recompute all)."""
    if policy == "full":
        return None
    if policy == "dots":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    if policy == "offload":
        return jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")
    raise ValueError(f"no checkpoint policy {policy!r}; choose one of {POLICIES}")


@functools.cache
def remat_runner(run: Callable[..., Any], policy: str) -> Callable[..., Any]:
    """`run` (a function of a layer and its inputs) rematerialised under `policy` (`remat.POLICIES`); `run` itself
    for none. Cached, so every layer of a kind shares one transformed function."""
    if policy == "none":
        return run
    return nnx.remat(run, policy=checkpoint_policy(policy))


# ----------------------------------------------------------------------------- vision tower


class VisionAttentionParams(nnx.Module):
    """q/k/v/o projections (with biases) of a ViT block, shared by the Qwen-VL families. The block keeps
    them as its own attributes (HF's `attn.qkv` / `attn.proj`), so subclasses add only norms and MLP."""

    def _init_attention(self, d: int, n: int, h: int, rngs: nnx.Rngs, param_dtype: jnp.dtype) -> None:
        self.scale = h**-0.5
        qkv_names = ("vision_embed", "vision_heads", "vision_head_dim")
        self.q_kernel_dnh = param(rngs, (d, n, h), qkv_names, param_dtype)
        self.k_kernel_dnh = param(rngs, (d, n, h), qkv_names, param_dtype)
        self.v_kernel_dnh = param(rngs, (d, n, h), qkv_names, param_dtype)
        self.q_bias_nh = param(None, (n, h), qkv_names[1:], param_dtype, init="zeros")
        self.k_bias_nh = param(None, (n, h), qkv_names[1:], param_dtype, init="zeros")
        self.v_bias_nh = param(None, (n, h), qkv_names[1:], param_dtype, init="zeros")
        self.o_kernel_nhd = param(rngs, (n, h, d), ("vision_heads", "vision_head_dim", "vision_embed"), param_dtype)
        self.o_bias_d = param(None, (d,), ("vision_embed",), param_dtype, init="zeros")

    def attend(self, y_pd: jax.Array, cos: jax.Array, sin: jax.Array, mask: AttentionMask) -> jax.Array:
        """Self-attention of normed patches y [P, D] among patches with equal mask ids, 2-D rotary; returns
        the projected output [P, D] (bias included), to be added to the residual."""
        cd = self.compute_dtype
        y = y_pd.astype(cd)
        q = constrain(jnp.einsum("pd,dnh->pnh", y, self.q_kernel_dnh[...].astype(cd)), PATCH_HEADS) + self.q_bias_nh[...].astype(cd)
        k = constrain(jnp.einsum("pd,dnh->pnh", y, self.k_kernel_dnh[...].astype(cd)), PATCH_HEADS) + self.k_bias_nh[...].astype(cd)
        v = constrain(jnp.einsum("pd,dnh->pnh", y, self.v_kernel_dnh[...].astype(cd)), PATCH_HEADS) + self.v_bias_nh[...].astype(cd)
        # transformers rotates vision q/k in fp32 then casts back.
        q = apply_rotary(q.astype(jnp.float32), cos, sin).astype(cd)
        k = apply_rotary(k.astype(jnp.float32), cos, sin).astype(cd)
        if mask.block is not None:
            o = local_segment_attention(q, k, v, mask.segment_ids, mask.block, self.scale)[None]
        elif mask.dense is not None:
            o = attention(q[None], k[None], v[None], mask.dense[None], self.scale, logits_names=PATCH_LOGITS)
        else:
            o = flash_attention(
                q[None], k[None], v[None], mask.segment_ids[None], impl=mask.impl, scale=self.scale, causal=False,
                q_names=PATCH_HEADS_WHOLE, kv_names=PATCH_HEADS_WHOLE,
            )
        o = constrain(o[0], PATCH_HEADS)
        out = constrain(jnp.einsum("pnh,nhd->pd", o, self.o_kernel_nhd[...].astype(cd)), PATCH_HIDDEN)
        return out + self.o_bias_d[...].astype(cd)


class PatchMerger(nnx.Module):
    """2x2 spatial merge -> MLP to the text width. Main merger: norm before the shuffle (over
    vision_embed); deepstack mergers: norm after it (over 4 * vision_embed). The norm is a LayerNorm
    (Qwen3-VL) or, with `rms_norm`, an RMSNorm with eps 1e-6 (Qwen2.5-VL's `ln_q`)."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        postshuffle_norm: bool,
        rngs: nnx.Rngs,
        param_dtype: jnp.dtype,
        compute_dtype: jnp.dtype,
        rms_norm: bool = False,
    ):
        v = cfg.vision
        self.merged_dim = v.hidden_size * v.merge_unit
        self.postshuffle_norm = postshuffle_norm
        self.compute_dtype = compute_dtype
        norm_dim = self.merged_dim if postshuffle_norm else v.hidden_size
        self.norm = RMSNorm(norm_dim, 1e-6, param_dtype=param_dtype) if rms_norm else LayerNorm(norm_dim, param_dtype=param_dtype)
        m = self.merged_dim
        self.fc1_kernel_mf = param(rngs, (m, m), ("vision_merge", "vision_mlp"), param_dtype)
        self.fc1_bias_f = param(None, (m,), ("vision_mlp",), param_dtype, init="zeros")
        self.fc2_kernel_fd = param(rngs, (m, v.out_hidden_size), ("vision_mlp", "embed"), param_dtype)
        self.fc2_bias_d = param(None, (v.out_hidden_size,), ("embed",), param_dtype, init="zeros")

    def __call__(self, x_pd: jax.Array) -> jax.Array:
        cd = self.compute_dtype
        if self.postshuffle_norm:
            x = self.norm(x_pd.reshape(-1, self.merged_dim))
        else:
            x = self.norm(x_pd).reshape(-1, self.merged_dim)
        x = constrain(x.astype(cd), PATCH_HIDDEN)
        hmid = constrain(jnp.einsum("mi,if->mf", x, self.fc1_kernel_mf[...].astype(cd)), PATCH_MLP)
        hmid = jax.nn.gelu(hmid + self.fc1_bias_f[...].astype(cd), approximate=False)  # torch nn.GELU(): exact erf
        out = constrain(jnp.einsum("mf,fd->md", hmid, self.fc2_kernel_fd[...].astype(cd)), PATCH_HIDDEN)
        return out + self.fc2_bias_d[...].astype(cd)


def vision_rotary_cos_sin(rotary_pos_p2: jax.Array, v: VisionConfig) -> tuple[jax.Array, jax.Array]:
    """2-D rotary tables [P, 1, head_dim] (fp32): first half-dim h then w frequencies, duplicated."""
    inv_freq = jnp.asarray(rope_inv_freq(v.head_dim // 2, v.rope_theta))  # [head_dim/4]
    freqs = rotary_pos_p2.astype(jnp.float32)[..., None] * inv_freq  # [P, 2, head_dim/4]
    freqs = freqs.reshape(freqs.shape[0], -1)  # [P, head_dim/2] = (h freqs, w freqs)
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, None, :]
    return jnp.cos(emb), jnp.sin(emb)


# ----------------------------------------------------------------------------- full model


class VisionLanguageDecoder(nnx.Module):
    """The text side every Qwen-VL family shares: token embedding, decoder layers, final norm, LM head,
    with the family's vision tower (`visual`, built by `make_visual`) writing merged image tokens at the
    image-pad slots. `model(tokens, positions, segment_ids, vision) -> hidden [B, T, D]` (after the final
    norm); `model.logits(hidden) -> [B, T, V]` fp32."""

    def __init__(
        self,
        cfg: ModelConfig,
        make_visual: Callable[..., nnx.Module],
        *,
        rngs: nnx.Rngs,
        param_dtype: jnp.dtype,
        compute_dtype: jnp.dtype,
        remat: bool | str | RematPlan,
        attention_impl: str,
        patch_attention_block: int | None = None,
        make_layer: Callable[..., nnx.Module] | None = None,
    ):
        """remat: `RematPlan.of`'s argument (decoder layers run under its `full_attention` policy, the vision tower
        under `vision`). make_layer(cfg, i, **kw) builds decoder layer i (default: `DecoderLayer`; a family with
        other layers, e.g. Qwen3-VL-MoE's routed MLPs, passes its own with the same attribute names)."""
        if attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl={attention_impl!r} is not available; choose one of {ATTENTION_IMPLS}")
        t = cfg.text
        self.cfg = cfg
        self.compute_dtype = compute_dtype
        self.remat = RematPlan.of(remat)
        self.attention_impl = attention_impl
        kw = dict(rngs=rngs, param_dtype=param_dtype, compute_dtype=compute_dtype)
        self.embed_vd = param(rngs, (t.vocab_size, t.hidden_size), ("vocab", "embed"), param_dtype)
        build = make_layer or (lambda cfg, i, **kw: DecoderLayer(cfg, **kw))
        self.layers = nnx.List([build(cfg, i, **kw) for i in range(t.num_hidden_layers)])
        self.final_norm = RMSNorm(t.hidden_size, t.rms_norm_eps, param_dtype=param_dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head_dv = param(rngs, (t.hidden_size, t.vocab_size), ("embed", "vocab"), param_dtype)
        if patch_attention_block is not None and patch_attention_block < 1:
            raise ValueError(f"patch_attention_block must be >= 1 or None, got {patch_attention_block}")
        self.visual = make_visual(cfg, remat=self.remat, attention_impl=attention_impl,
                                  patch_attention_block=patch_attention_block, **kw)

    def lm_head_kernel(self) -> jax.Array:
        """Output projection [D, V] (the transposed embedding when tied)."""
        if self.cfg.tie_word_embeddings:
            return self.embed_vd[...].T
        return self.lm_head_dv[...]

    def embed(self, tokens_bt: jax.Array) -> jax.Array:
        return constrain(jnp.take(self.embed_vd[...], tokens_bt, axis=0).astype(self.compute_dtype), ROWS_HIDDEN)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        vision: Any = None,
    ) -> jax.Array:
        x, deepstack, slots = self.embed_inputs(tokens, vision)
        cos, sin = mrope_cos_sin(positions, self.cfg, self.compute_dtype)
        mask = text_mask(segment_ids, self.attention_impl)
        run = remat_runner(run_layer, self.remat.full_attention)
        for i, layer in enumerate(self.layers):
            x = run(layer, x, cos, sin, mask)
            if i < len(deepstack):
                x = add_at_slots(x, slots, deepstack[i])
        return self.final_norm(x)

    def embed_inputs(
        self, tokens_bt: jax.Array, vision: Any
    ) -> tuple[jax.Array, list[jax.Array], jax.Array | None]:
        """Token embeddings [B, T, D] with the merged image features written at the image-pad slots.

        Also returns the deepstack features (added after decoder layer k; none for Qwen2.5-VL) and the flat
        [B*T] slots they go to; padding slots point past the end and are dropped by the scatters.
        """
        b, t = tokens_bt.shape
        x = self.embed(tokens_bt)
        if vision is None:
            return x, [], None
        merged, deepstack = self.visual(vision)
        slots = image_slots(vision, b, t)
        return constrain(set_at_slots(x, slots, merged), ROWS_HIDDEN), deepstack, slots

    def logits(self, hidden_btd: jax.Array) -> jax.Array:
        """Full-vocabulary logits [B, T, V] in fp32 (use `token_logprobs` for training)."""
        kernel = self.lm_head_kernel().astype(self.compute_dtype)
        return jnp.einsum("btd,dv->btv", hidden_btd.astype(self.compute_dtype), kernel, preferred_element_type=jnp.float32)


class TokenImageRows(NamedTuple):
    """Vision reuse: the row of the tower's [M] output read at each flat [B*T] token slot (-1: not an image token).
    A row shown by several slots is gathered into each; autodiff sums its gradients over them."""

    rows: jax.Array


def image_slots(vision: Any, b: int, t: int) -> jax.Array | TokenImageRows:
    """Where a [B, T] batch's image features go: flat [B*T] slots of the tower rows (`image_token_index`, one
    slot per row; B*T dropped), or, when the batch carries `token_image_rows` (vision reuse), a gather map."""
    if getattr(vision, "token_image_rows", None) is not None:
        return TokenImageRows(vision.token_image_rows.reshape(b * t))
    return jnp.where(vision.image_token_index < 0, b * t, vision.image_token_index)


def _gathered(slots: TokenImageRows, values: jax.Array, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    rows = slots.rows
    return rows >= 0, jnp.take(values, jnp.maximum(rows, 0), axis=0).astype(dtype)


def set_at_slots(x_btd: jax.Array, slots: jax.Array | TokenImageRows, values: jax.Array) -> jax.Array:
    """x with the tower rows `values` [M, D] written at `slots` (from `image_slots`)."""
    b, t, d = x_btd.shape
    flat = x_btd.reshape(b * t, d)
    if isinstance(slots, TokenImageRows):
        is_image, gathered = _gathered(slots, values, x_btd.dtype)
        return jnp.where(is_image[:, None], gathered, flat).reshape(b, t, d)
    return flat.at[slots].set(values.astype(x_btd.dtype), mode="drop").reshape(b, t, d)


def add_at_slots(x_btd: jax.Array, slots: jax.Array | TokenImageRows, values: jax.Array) -> jax.Array:
    """x with the tower rows `values` [M, D] added at `slots` (from `image_slots`; out-of-range slots dropped)."""
    b, t, d = x_btd.shape
    flat = x_btd.reshape(b * t, d)
    if isinstance(slots, TokenImageRows):
        is_image, gathered = _gathered(slots, values, x_btd.dtype)
        return (flat + jnp.where(is_image[:, None], gathered, jnp.zeros_like(gathered))).reshape(b, t, d)
    return flat.at[slots].add(values.astype(x_btd.dtype), mode="drop").reshape(b, t, d)


def token_logprobs(
    model: PolicyModel,
    hidden_btd: jax.Array,
    targets_bt: jax.Array,
    *,
    chunk_size: int = 512,
    return_entropy: bool = False,
    temperature: float = 1.0,
) -> tuple[jax.Array, jax.Array | None]:
    """log p(target) [B, T] (and entropy [B, T]) of `softmax(logits / temperature)`, without full-batch fp32 logits.

    `temperature` is the rollout's sampling temperature: the engine (SGLang and ours) reports log-probs of the
    tempered distribution it sampled from, so the trainer must score the same policy (as slime's loss divides
    the logits by `--rollout-temperature`). It is static (a Python float): one program per run.

    The sequence is cut into chunks of `chunk_size`; each chunk's [B, C, V] fp32 logits live only
    inside one `lax.map` step and are recomputed in the backward pass (`jax.checkpoint`), so peak
    memory is O(B * C * V) instead of O(B * T * V). Under context parallelism the chunks are taken in row order and
    each chunk's C positions are split over the context group by the same `sequence` constraint (XLA reshards the
    hidden states into that order for the loop). Taking one chunk of every block per step instead (no reshard)
    made XLA:CPU's collectives deadlock in the train step (`tests/test_train_layouts.py`: fsdp_cp, and even
    fsdp_tp where the context axis has size 1), so it is not used.
    """
    b, t, d = hidden_btd.shape
    c = max(1, min(chunk_size, t))
    n_chunks = -(-t // c)
    pad = n_chunks * c - t
    h = jnp.pad(hidden_btd, ((0, 0), (0, pad), (0, 0)))
    y = jnp.pad(targets_bt, ((0, 0), (0, pad)))
    h = h.reshape(b, n_chunks, c, d).transpose(1, 0, 2, 3)
    y = y.reshape(b, n_chunks, c).transpose(1, 0, 2)
    kernel = model.lm_head_kernel().astype(model.compute_dtype)
    cd = model.compute_dtype

    @jax.checkpoint
    def chunk(args: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        hc, yc = args
        hc = constrain(hc.astype(cd), ROWS_HIDDEN)
        logits = constrain(jnp.einsum("bcd,dv->bcv", hc, kernel, preferred_element_type=jnp.float32), ROWS_VOCAB)
        if temperature != 1.0:
            logits = logits / jnp.float32(temperature)
        lse = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, yc[..., None].astype(jnp.int32), axis=-1)[..., 0]
        ent = lse - jnp.sum(jax.nn.softmax(logits, axis=-1) * logits, axis=-1) if return_entropy else jnp.zeros_like(lse)
        return picked - lse, ent

    lp, ent = jax.lax.map(chunk, (h, y))
    lp = lp.transpose(1, 0, 2).reshape(b, n_chunks * c)[:, :t]
    if not return_entropy:
        return lp, None
    return lp, ent.transpose(1, 0, 2).reshape(b, n_chunks * c)[:, :t]


# ----------------------------------------------------------------------------- learned-position vision tower


class LearnedPositionVisionBlock(VisionAttentionParams):
    """Pre-LayerNorm ViT block with a two-matrix MLP (fc1, act, fc2); attention only among patches of the same
    image frame, 2-D rotary. Qwen3-VL's and Qwen3.5's block (transformers' `Qwen3VLVisionBlock`)."""

    def __init__(self, cfg: Any, *, rngs: nnx.Rngs, param_dtype: jnp.dtype, compute_dtype: jnp.dtype):
        v = cfg.vision
        d, f = v.hidden_size, v.intermediate_size
        self.compute_dtype = compute_dtype
        self.act_name = v.hidden_act
        self.norm1 = LayerNorm(d, param_dtype=param_dtype)
        self.norm2 = LayerNorm(d, param_dtype=param_dtype)
        self._init_attention(d, v.num_heads, v.head_dim, rngs, param_dtype)
        self.fc1_kernel_df = param(rngs, (d, f), ("vision_embed", "vision_mlp"), param_dtype)
        self.fc1_bias_f = param(None, (f,), ("vision_mlp",), param_dtype, init="zeros")
        self.fc2_kernel_fd = param(rngs, (f, d), ("vision_mlp", "vision_embed"), param_dtype)
        self.fc2_bias_d = param(None, (d,), ("vision_embed",), param_dtype, init="zeros")

    def __call__(self, x_pd: jax.Array, cos: jax.Array, sin: jax.Array, mask: AttentionMask) -> jax.Array:
        cd = self.compute_dtype
        x_pd = constrain(x_pd, PATCH_HIDDEN)
        x = x_pd + self.attend(self.norm1(x_pd), cos, sin, mask)
        y = self.norm2(x).astype(cd)
        hmid = constrain(jnp.einsum("pd,df->pf", y, self.fc1_kernel_df[...].astype(cd)), PATCH_MLP)
        hmid = activation(self.act_name)(hmid + self.fc1_bias_f[...].astype(cd))
        out = constrain(jnp.einsum("pf,fd->pd", hmid, self.fc2_kernel_fd[...].astype(cd)), PATCH_HIDDEN)
        return x + out + self.fc2_bias_d[...].astype(cd)


class LearnedPositionVisionTower(nnx.Module):
    """Patch embed (with bias) + a learned square position table bilinearly resampled to each image (host taps in
    `vision.VisionInputs`) + `LearnedPositionVisionBlock`s + merger, and deepstack mergers after the blocks of
    `cfg.vision.deepstack_visual_indexes` (none for Qwen3.5). Returns merged image tokens [M, D_text] and the
    deepstack features [M, D_text] (padding patches give garbage rows that the token scatter drops).

    Qwen3-VL's tower, shared so that Qwen3.5 reuses it without importing another family's file; its HF names are
    `hf_links.learned_position_vision_links`."""

    def __init__(
        self,
        cfg: Any,
        *,
        rngs: nnx.Rngs,
        param_dtype: jnp.dtype,
        compute_dtype: jnp.dtype,
        remat: bool | str | RematPlan = False,
        attention_impl: str = "xla",
        patch_attention_block: int | None = None,
    ):
        v = cfg.vision
        self.cfg = cfg
        self.compute_dtype = compute_dtype
        self.remat = RematPlan.of(remat)
        self.attention_impl = attention_impl
        self.patch_attention_block = patch_attention_block
        self.patch_kernel_cd = param(rngs, (v.patch_dim, v.hidden_size), ("vision_patch", "vision_embed"), param_dtype)
        self.patch_bias_d = param(None, (v.hidden_size,), ("vision_embed",), param_dtype, init="zeros")
        self.pos_embed_sd = param(rngs, (v.num_position_embeddings, v.hidden_size), ("vision_pos", "vision_embed"), param_dtype)
        kw = dict(rngs=rngs, param_dtype=param_dtype, compute_dtype=compute_dtype)
        self.blocks = nnx.List([LearnedPositionVisionBlock(cfg, **kw) for _ in range(v.depth)])
        self.merger = PatchMerger(cfg, postshuffle_norm=False, **kw)
        self.deepstack_mergers = nnx.List(
            [PatchMerger(cfg, postshuffle_norm=True, **kw) for _ in v.deepstack_visual_indexes]
        )

    def __call__(self, vis: Any) -> tuple[jax.Array, list[jax.Array]]:
        cd = self.compute_dtype
        x = jnp.einsum("pc,cd->pd", vis.pixel_values.astype(cd), self.patch_kernel_cd[...].astype(cd))
        x = x + self.patch_bias_d[...].astype(cd)
        table = self.pos_embed_sd[...].astype(cd)
        x = x + jnp.einsum("pj,pjd->pd", vis.pos_interp_w.astype(cd), jnp.take(table, vis.pos_interp_idx, axis=0))
        cos, sin = vision_rotary_cos_sin(vis.patch_rotary_pos, self.cfg.vision)
        mask = patch_mask(vis.patch_segment_ids, self.attention_impl, self.patch_attention_block)
        deepstack = []
        ds_index = {layer: j for j, layer in enumerate(self.cfg.vision.deepstack_visual_indexes)}
        run = remat_runner(run_block, self.remat.vision)
        for i, block in enumerate(self.blocks):
            x = run(block, x, cos, sin, mask)
            if i in ds_index:
                deepstack.append(self.deepstack_mergers[ds_index[i]](x))
        return self.merger(x), deepstack
