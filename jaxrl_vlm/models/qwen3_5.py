"""Qwen3.5 dense (hybrid Gated DeltaNet / gated attention text decoder, Qwen3-VL's vision tower) in plain Flax NNX.

Semantics follow transformers' `modeling_qwen3_5.py` (5.24). Top to bottom:

- the gated delta rule as pure functions: `chunk_gated_delta_rule` (prefill and training: a `lax.scan` over chunks,
  with resets at segment starts) and `recurrent_gated_delta_step` (decode); both carry the state [B, H, Dk, Dv] fp32;
- `causal_depthwise_conv`: the short causal conv over q/k/v, whose taps never cross a segment boundary;
- `GatedDeltaNet` (linear attention): in_proj_qkv / z / b / a, conv + SiLU, l2-normed q/k, decay
  g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), gated RMSNorm, out_proj; value heads may outnumber
  key heads (key head j serves value heads j*G .. j*G+G-1, transformers' `repeat_interleave`);
- `GatedAttention` (full attention): q_proj yields query and an output gate per head, zero-centred q/k RMSNorm,
  partial rotary (the first `rotary_dim` dims of a head) with interleaved M-RoPE;
- `Qwen3_5`, the `PolicyModel` (RMSNorms are zero-centred: x * (1 + w)); the vision tower is the shared
  `layers.LearnedPositionVisionTower` without deepstack;
- HF tensor names (`weight_links`), and the engine functions against `HybridCache`: paged K/V for the
  full-attention layers, per-slot conv and recurrent state for the linear layers.

Packed rows (`segment_ids` [B, T], 0 = padding): full attention is causal AND same-segment; a linear layer starts
every segment from a zero conv window and a zero recurrent state.
Under context parallelism (an activation layout whose `sequence` splits T) the linear layers' conv and delta
rule run on contiguous blocks of each row, passing a conv halo and the recurrent state across blocks
(`linear_context`).

Logical axes of the linear layers: `linear_k_heads`, `linear_v_heads` (on the `tensor` mesh axis),
`linear_head_dim`, `conv_taps`.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jaxrl_vlm.models.activation_sharding import ROWS_HIDDEN, ROWS_KV, ROWS_Q, constrain, current
from jaxrl_vlm.models.config import Qwen3_5Config, Qwen35TextConfig
from jaxrl_vlm.models.families import FamilyModel
from jaxrl_vlm.models.hf_links import (
    Link,
    ParamPath,
    copy_link,
    dense_link,
    heads_in_link,
    heads_out_link,
    learned_position_vision_links,
)
from jaxrl_vlm.models.layers import (
    ATTENTION_IMPLS,
    AttentionMask,
    LearnedPositionVisionTower,
    RMSNorm,
    TextMLP,
    apply_rotary,
    image_slots,
    param,
    remat_runner,
    run_block,
    set_at_slots,
    text_attention,
    text_mask,
)
from jaxrl_vlm.models.linear_context import context_causal_conv, context_chunk_gated_delta_rule, context_split
from jaxrl_vlm.models.moe import SparseMoE
from jaxrl_vlm.models.paged_kv import CacheAttention, decode_attention, gather_attention, page_slots
from jaxrl_vlm.models.remat import RematPlan
from jaxrl_vlm.models.rope import rope_inv_freq

F32 = jnp.float32  # the Gated DeltaNet's accumulation: float32, or wider when the inputs are (`accumulation_dtype`)
DEFAULT_CHUNK = 64  # transformers' chunk size of the chunked delta rule


# ----------------------------------------------------------------------------- gated delta rule (pure)


def accumulation_dtype(dtype: Any) -> Any:
    """The delta rule's dtype for inputs of `dtype`: at least float32 (bf16 and float32 models accumulate in float32,
    as transformers does), float64 for a float64 model, so a float64 check is not capped at float32 accuracy."""
    return jnp.promote_types(dtype, F32)


def _pad_time(x: jax.Array, pad: int, value: Any = 0) -> jax.Array:
    return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=value) if pad else x


@jax.custom_vjp
def unit_lower_inverse(strict_lower: jax.Array) -> jax.Array:
    """(I + L)^-1 for strictly lower-triangular L [..., C, C], by block doubling: the inverse of
    [[A, 0], [X, B]] is [[A^-1, 0], [-B^-1 X A^-1, B^-1]], applied to 1x1, 2x2, 4x4, ... diagonal blocks (C padded
    to a power of two with the identity). Every product is of blocks of the inverse itself, so the rounding is that
    of forward substitution (a triangular solve). Plain batched matmuls: XLA:CPU's triangular-solve call inside a
    rematerialised scan stalled intermittently in our runs, and the Neumann product (I - L)(I + L^2)(I + L^4)...
    formed powers of L that reach 1e17 when keys are correlated and decay is slow (errors of 1e10 measured)."""
    c = strict_lower.shape[-1]
    size = 1 << max(c - 1, 0).bit_length()
    lead = strict_lower.shape[:-2]
    m = jnp.pad(strict_lower, [(0, 0)] * len(lead) + [(0, size - c)] * 2) if size > c else strict_lower
    inverse, s = jnp.ones((*lead, size, 1, 1), m.dtype), 1  # the inverses of the s x s diagonal blocks
    while s < size:
        p = size // (2 * s)
        pairs = jnp.diagonal(m.reshape(*lead, p, 2 * s, p, 2 * s), axis1=-4, axis2=-2)  # [..., 2s, 2s, P]
        lower = jnp.moveaxis(pairs, -1, -3)[..., s:, :s]  # [..., P, s, s]: X of each pair of blocks
        blocks = inverse.reshape(*lead, p, 2, s, s)
        a, b = blocks[..., 0, :, :], blocks[..., 1, :, :]
        top = jnp.concatenate([a, jnp.zeros_like(a)], axis=-1)
        inverse = jnp.concatenate([top, jnp.concatenate([-(b @ lower @ a), b], axis=-1)], axis=-2)
        s *= 2
    return inverse.reshape(*lead, size, size)[..., :c, :c]


def _unit_lower_inverse_fwd(strict_lower: jax.Array) -> tuple[jax.Array, jax.Array]:
    inverse = unit_lower_inverse(strict_lower)
    return inverse, inverse


def _unit_lower_inverse_bwd(inverse: jax.Array, cotangent: jax.Array) -> tuple[jax.Array]:
    """d(M^-1) = -M^-1 dM M^-1, restricted to the strictly lower L: two matmuls with the inverse (differentiating
    the doubling steps instead compiles ~2x slower and rounds no better)."""
    t = jnp.swapaxes(inverse, -1, -2)
    return (jnp.tril(-(t @ cotangent @ t), -1),)


unit_lower_inverse.defvjp(_unit_lower_inverse_fwd, _unit_lower_inverse_bwd)


def chunk_gated_delta_rule(
    q_bthk: jax.Array,
    k_bthk: jax.Array,
    v_bthv: jax.Array,
    g_bth: jax.Array,
    beta_bth: jax.Array,
    state_bhkv: jax.Array,
    run_bt: jax.Array | None = None,
    chunk_size: int = DEFAULT_CHUNK,
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule over T steps, chunk by chunk (transformers' `torch_chunk_gated_delta_rule`, UT form).

    q, k [B, T, H, Dk] (already l2-normalised, q scaled by Dk^-0.5, key heads repeated to the H value heads);
    v [B, T, H, Dv]; g [B, T, H] log-decay (<= 0); beta [B, T, H]; state [B, H, Dk, Dv] before step 0.
    run_bt int [B, T], non-decreasing: a step whose run differs from its predecessor's starts from a zero state
    (a new packed segment); run 0 continues `state`. None: one run. Steps with g = beta = 0 and k = 0 leave the
    state unchanged (how the callers pad). Returns o [B, T, H, Dv] fp32 and the state after step T-1 (fp32).
    """
    b, t, h, dk = q_bthk.shape
    dv = v_bthv.shape[-1]
    c = chunk_size
    pad = (-t) % c
    n = (t + pad) // c
    run = jnp.zeros((b, t), jnp.int32) if run_bt is None else run_bt.astype(jnp.int32)
    run = jnp.pad(run, ((0, 0), (0, pad)), mode="edge") if pad else run
    acc = accumulation_dtype(q_bthk.dtype)
    q, k, v = (_pad_time(x.astype(acc), pad) for x in (q_bthk, k_bthk, v_bthv))
    g, beta = (_pad_time(x.astype(acc), pad) for x in (g_bth, beta_bth))

    def chunks(x: jax.Array) -> jax.Array:  # [B, T', H, ...] -> [B, H, N, C, ...]
        x = x.reshape(b, n, c, h, *x.shape[3:])
        return jnp.moveaxis(x, 3, 1)

    q, k, v, g, beta = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)
    run_nc = run.reshape(b, 1, n, c)
    prev_last = jnp.concatenate([run_nc[:, :, :1, :1], run_nc[:, :, :-1, -1:]], axis=2)  # run before each chunk
    last = run_nc[..., -1:]
    same = run_nc[..., :, None] == run_nc[..., None, :]  # [B, 1, N, C, C]
    causal = jnp.tril(jnp.ones((c, c), bool))
    cont = (run_nc == prev_last).astype(acc)  # step i still reads the state entering the chunk
    surv = (run_nc == last).astype(acc)  # step i still reaches the state leaving the chunk

    cum = jnp.cumsum(g, axis=-1)  # [B, H, N, C]
    # decay[i, j] = sum of g over (j, i], summed on its own: cum_i - cum_j would carry the rounding of the whole
    # |cum| (up to ~300 over a chunk) into every factor (10x the error of the rule, measured against float64).
    strict_mask = jnp.tril(jnp.ones((c, c), bool), -1)
    decay = jnp.cumsum(jnp.where(strict_mask, g[..., :, None], 0.0), axis=-2)  # [B, H, N, C, C]
    keep = causal & same
    pair = jnp.where(keep, jnp.exp(jnp.where(keep, decay, 0.0)), 0.0)
    kb, vb = k * beta[..., None], v * beta[..., None]
    strict = jnp.where(strict_mask, jnp.einsum("bhnik,bhnjk->bhnij", kb, k) * pair, 0.0)
    inverse = unit_lower_inverse(strict)
    new_values = inverse @ vb  # [B, H, N, C, Dv]
    k_cumdecay = inverse @ (kb * (jnp.exp(cum) * cont)[..., None])  # [B, H, N, C, Dk]
    intra = jnp.einsum("bhnik,bhnjk->bhnij", q, k) * pair
    q_dec = q * (jnp.exp(cum) * cont)[..., None]
    k_dec = k * (jnp.exp(decay[..., -1, :]) * surv)[..., None]  # decay from step j to the chunk's end
    chunk_decay = jnp.exp(cum[..., -1]) * cont[..., -1]  # [B, H, N]

    def step(s: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        nv, kcd, qd, kd, att, dec = xs
        v_new = nv - jnp.einsum("bhck,bhkv->bhcv", kcd, s)
        o = jnp.einsum("bhck,bhkv->bhcv", qd, s) + jnp.einsum("bhij,bhjv->bhiv", att, v_new)
        s = s * dec[..., None, None] + jnp.einsum("bhck,bhcv->bhkv", kd, v_new)
        return s, o

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (new_values, k_cumdecay, q_dec, k_dec, intra, chunk_decay))
    state, o = jax.lax.scan(step, state_bhkv.astype(acc), xs)  # o [N, B, H, C, Dv]
    o = jnp.moveaxis(o, 0, 2).reshape(b, h, n * c, dv)[:, :, :t]
    return jnp.moveaxis(o, 1, 2), state


def recurrent_gated_delta_step(
    q_bhk: jax.Array, k_bhk: jax.Array, v_bhv: jax.Array, g_bh: jax.Array, beta_bh: jax.Array, state_bhkv: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """One step of the gated delta rule (transformers' `torch_recurrent_gated_delta_rule` for T = 1): decay the
    state, write the part of v that the state does not already predict from k, read with q. Inputs as
    `chunk_gated_delta_rule` without the time axis; returns o [B, H, Dv] and the new state (fp32)."""
    acc = accumulation_dtype(q_bhk.dtype)
    s = state_bhkv.astype(acc) * jnp.exp(g_bh.astype(acc))[..., None, None]
    k, q = k_bhk.astype(acc), q_bhk.astype(acc)
    delta = (v_bhv.astype(acc) - jnp.einsum("bhkv,bhk->bhv", s, k)) * beta_bh.astype(acc)[..., None]
    s = s + k[..., :, None] * delta[..., None, :]
    return jnp.einsum("bhkv,bhk->bhv", s, q), s


def recurrent_gated_delta_rule(
    q_bthk: jax.Array, k_bthk: jax.Array, v_bthv: jax.Array, g_bth: jax.Array, beta_bth: jax.Array,
    state_bhkv: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """`recurrent_gated_delta_step` scanned over T (the reference for the chunked form; one run)."""

    def step(s: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        o, s = recurrent_gated_delta_step(*xs, s)
        return s, o

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q_bthk, k_bthk, v_bthv, g_bth, beta_bth))
    state, o = jax.lax.scan(step, state_bhkv.astype(accumulation_dtype(q_bthk.dtype)), xs)
    return jnp.moveaxis(o, 0, 1), state


def causal_depthwise_conv(x_btc: jax.Array, w_kc: jax.Array, prev_bkc: jax.Array, run_bt: jax.Array) -> jax.Array:
    """Causal depthwise conv: out_t = sum_i w[i] * x[t - (K-1) + i], where x before step 0 is `prev_bkc`
    [B, K-1, C] (the stored conv window, part of run 0) and taps that reach into another run (another packed
    segment) read zero. x [B, T, C], w [K, C], run [B, T] non-decreasing. Returns [B, T, C] (no activation)."""
    kk = w_kc.shape[0]
    t = x_btc.shape[1]
    xs = jnp.concatenate([prev_bkc.astype(x_btc.dtype), x_btc], axis=1)
    run_ext = jnp.concatenate([jnp.zeros((run_bt.shape[0], kk - 1), run_bt.dtype), run_bt], axis=1)
    out = jnp.zeros_like(x_btc)
    for i in range(kk):
        tap = jnp.where((run_ext[:, i : i + t] == run_bt)[..., None], xs[:, i : i + t], 0)
        out = out + tap * w_kc[i]
    return out


def segment_runs(segment_ids_bt: jax.Array) -> jax.Array:
    """Run ids [B, T] (0, 1, ...): a new run wherever the segment id changes from the previous position."""
    change = (segment_ids_bt[:, 1:] != segment_ids_bt[:, :-1]).astype(jnp.int32)
    return jnp.concatenate([jnp.zeros_like(change[:, :1]), jnp.cumsum(change, axis=1)], axis=1)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x * rsqrt(sum x^2 + eps) over the last axis (transformers' / FLA's `l2norm`)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


# ----------------------------------------------------------------------------- positions


def mrope_axis(section: tuple[int, ...], half: int, interleaved: bool) -> np.ndarray:
    """Which of (t, h, w) drives each of the `half` rotary frequencies (transformers' `recomposition_frequencies`)."""
    if not interleaved:
        return np.repeat(np.arange(3, dtype=np.int32), section)
    i = np.arange(half)
    axis = np.zeros((half,), np.int32)
    axis[(i % 3 == 1) & (i < 3 * section[1])] = 1
    axis[(i % 3 == 2) & (i < 3 * section[2])] = 2
    return axis


def partial_mrope_cos_sin(positions_3bt: jax.Array, t: Qwen35TextConfig, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, rotary_dim] of the rotated leading dims of a full-attention head, from M-RoPE ids [3, B, T]."""
    inv_freq = jnp.asarray(rope_inv_freq(t.rotary_dim, t.rope_theta))
    axis = jnp.asarray(mrope_axis(t.mrope_section, t.rotary_dim // 2, t.mrope_interleaved))
    pos = jnp.take(positions_3bt.astype(F32), axis, axis=0)  # [R/2, B, T]
    angles = jnp.moveaxis(pos, 0, -1) * inv_freq
    emb = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_partial_rotary(x_btnh: jax.Array, cos_btr: jax.Array, sin_btr: jax.Array) -> jax.Array:
    """Rotate the first rotary_dim dims of every head (half-split layout); the rest pass through."""
    r = cos_btr.shape[-1]
    rotated = apply_rotary(x_btnh[..., :r], cos_btr[:, :, None, :], sin_btr[:, :, None, :])
    return jnp.concatenate([rotated, x_btnh[..., r:]], axis=-1)


# ----------------------------------------------------------------------------- layers


class OffsetRMSNorm(nnx.Module):
    """Zero-centred RMSNorm: normalised(x) * (1 + scale), in fp32, then cast (transformers' `Qwen3_5RMSNorm`)."""

    def __init__(self, dim: int, eps: float, *, param_dtype: jnp.dtype):
        self.eps = eps
        self.scale = param(None, (dim,), ("norm",), param_dtype, init="zeros")

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(F32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * (1.0 + self.scale[...].astype(F32))).astype(x.dtype)


class LinearState(NamedTuple):
    """What a linear layer carries between calls: conv window [B, K-1, C] (pre-conv q|k|v inputs) and the
    delta-rule state [B, Hv, Dk, Dv] fp32."""

    conv: jax.Array
    recurrent: jax.Array


class GatedDeltaNet(nnx.Module):
    """Gated DeltaNet linear attention (transformers' `Qwen3_5GatedDeltaNet`)."""

    def __init__(self, cfg: Qwen3_5Config, *, rngs: nnx.Rngs, param_dtype: jnp.dtype, compute_dtype: jnp.dtype):
        t = cfg.text
        d, hk, hv, dk, dv, kk = (t.hidden_size, t.linear_num_key_heads, t.linear_num_value_heads, t.linear_key_head_dim,
                                 t.linear_value_head_dim, t.linear_conv_kernel_dim)
        self.compute_dtype = compute_dtype
        self.group = hv // hk
        self.chunk_size = DEFAULT_CHUNK  # static; tests shrink it to cross chunk boundaries on tiny inputs
        kn, vn = ("embed", "linear_k_heads", "linear_head_dim"), ("embed", "linear_v_heads", "linear_head_dim")
        self.q_kernel_dhk = param(rngs, (d, hk, dk), kn, param_dtype)
        self.k_kernel_dhk = param(rngs, (d, hk, dk), kn, param_dtype)
        self.v_kernel_dhv = param(rngs, (d, hv, dv), vn, param_dtype)
        self.z_kernel_dhv = param(rngs, (d, hv, dv), vn, param_dtype)
        self.b_kernel_dh = param(rngs, (d, hv), ("embed", "linear_v_heads"), param_dtype)
        self.a_kernel_dh = param(rngs, (d, hv), ("embed", "linear_v_heads"), param_dtype)
        self.conv_q_xhk = param(rngs, (kk, hk, dk), ("conv_taps", "linear_k_heads", "linear_head_dim"), param_dtype)
        self.conv_k_xhk = param(rngs, (kk, hk, dk), ("conv_taps", "linear_k_heads", "linear_head_dim"), param_dtype)
        self.conv_v_xhv = param(rngs, (kk, hv, dv), ("conv_taps", "linear_v_heads", "linear_head_dim"), param_dtype)
        self.a_log_h = param(None, (hv,), ("linear_v_heads",), param_dtype, init="zeros")  # decay rate A = 1
        self.dt_bias_h = param(None, (hv,), ("linear_v_heads",), param_dtype, init="ones")
        self.norm = RMSNorm(dv, t.rms_norm_eps, param_dtype=param_dtype)  # gated, centred at 1 (not zero-centred)
        self.o_kernel_hvd = param(rngs, (hv, dv, d), ("linear_v_heads", "linear_head_dim", "embed"), param_dtype)

    def conv_kernel(self) -> jax.Array:
        """The depthwise conv taps [K, C] over the q|k|v channels in HF's order."""
        kk = self.conv_q_xhk.shape[0]
        parts = (self.conv_q_xhk, self.conv_k_xhk, self.conv_v_xhv)
        return jnp.concatenate([p[...].reshape(kk, -1) for p in parts], axis=-1).astype(self.compute_dtype)

    def __call__(
        self,
        x_btd: jax.Array,
        run_bt: jax.Array,
        state: LinearState,
        valid_bt: jax.Array | None = None,
        length: jax.Array | None = None,
    ) -> tuple[jax.Array, LinearState]:
        """x [B, T, D] -> out [B, T, D] and the state after the last valid step.

        run_bt: `segment_runs` (run 0 continues `state`); valid_bt: False at padding steps, which leave the state
        as it is; length: valid steps per row (scalar; the conv window kept is the one ending there; default T).
        T = 1 takes the one-step recurrent form (decode), longer inputs the chunked form. Under an activation layout
        that splits the sequence (context parallelism), the conv and the chunked rule run block by block on the
        devices of the context group (`linear_context`), with the same result."""
        cd = self.compute_dtype
        b, t, _ = x_btd.shape
        hk, dk = self.q_kernel_dhk.shape[1:]
        hv, dv = self.v_kernel_dhv.shape[1:]
        x = x_btd.astype(cd)
        proj = lambda w, spec: jnp.einsum(spec, x, w[...].astype(cd))  # noqa: E731
        q = proj(self.q_kernel_dhk, "btd,dhk->bthk").reshape(b, t, -1)
        k = proj(self.k_kernel_dhk, "btd,dhk->bthk").reshape(b, t, -1)
        v = proj(self.v_kernel_dhv, "btd,dhv->bthv").reshape(b, t, -1)
        z = proj(self.z_kernel_dhv, "btd,dhv->bthv")
        acc = accumulation_dtype(cd)
        beta = jax.nn.sigmoid(proj(self.b_kernel_dh, "btd,dh->bth")).astype(acc)
        a = proj(self.a_kernel_dh, "btd,dh->bth").astype(acc)
        g = -jnp.exp(self.a_log_h[...].astype(acc)) * jax.nn.softplus(a + self.dt_bias_h[...].astype(acc))
        mixed = jnp.concatenate([q, k, v], axis=-1)  # [B, T, C]
        split = context_split(current(), (b, t, hv, dk)) if t > 1 else None
        if split is None:
            conv = causal_depthwise_conv(mixed, self.conv_kernel(), state.conv, run_bt)
        else:
            conv = context_causal_conv(causal_depthwise_conv, mixed, self.conv_kernel(), state.conv, run_bt, split)
        conv = jax.nn.silu(conv)
        n = hk * dk
        q = conv[..., :n].reshape(b, t, hk, dk).astype(acc)
        k = conv[..., n : 2 * n].reshape(b, t, hk, dk).astype(acc)
        v = conv[..., 2 * n :].reshape(b, t, hv, dv)
        q = jnp.repeat(l2_normalize(q), self.group, axis=2) * (dk**-0.5)
        k = jnp.repeat(l2_normalize(k), self.group, axis=2)
        if valid_bt is not None:
            beta = jnp.where(valid_bt[..., None], beta, 0.0)
            g = jnp.where(valid_bt[..., None], g, 0.0)
            k = jnp.where(valid_bt[..., None, None], k, 0.0)
        if t == 1:
            o, rec = recurrent_gated_delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state.recurrent)
            o = o[:, None]
        elif split is not None:
            rule = partial(chunk_gated_delta_rule, chunk_size=self.chunk_size)
            o, rec = context_chunk_gated_delta_rule(rule, q, k, v, g, beta, state.recurrent, run_bt, split)
        else:
            o, rec = chunk_gated_delta_rule(q, k, v, g, beta, state.recurrent, run_bt, self.chunk_size)
        o = o.astype(cd)
        gated = self.norm(o).astype(acc) * jax.nn.silu(z.astype(acc))
        out = jnp.einsum("bthv,hvd->btd", gated.astype(cd), self.o_kernel_hvd[...].astype(cd))
        window = jnp.concatenate([state.conv.astype(mixed.dtype), mixed], axis=1)
        kk = state.conv.shape[1]
        end = t if length is None else length
        new_conv = jax.lax.dynamic_slice_in_dim(window, end, kk, axis=1)
        return constrain(out, ROWS_HIDDEN), LinearState(new_conv, rec)

    def zero_state(self, batch: int) -> LinearState:
        kk = self.conv_q_xhk.shape[0]
        c = sum(int(np.prod(p.shape[1:])) for p in (self.conv_q_xhk, self.conv_k_xhk, self.conv_v_xhv))
        hv, dv = self.v_kernel_dhv.shape[1:]
        dk = self.q_kernel_dhk.shape[2]
        return LinearState(jnp.zeros((batch, kk - 1, c), self.compute_dtype),
                           jnp.zeros((batch, hv, dk, dv), accumulation_dtype(self.compute_dtype)))


class GatedAttention(nnx.Module):
    """GQA attention with an output gate (transformers' `Qwen3_5Attention`): q_proj gives query and gate per head,
    zero-centred q/k RMSNorm, partial M-RoPE, out = o_proj(attn * sigmoid(gate))."""

    def __init__(self, cfg: Qwen3_5Config, *, rngs: nnx.Rngs, param_dtype: jnp.dtype, compute_dtype: jnp.dtype):
        t = cfg.text
        d, n, kv, h = t.hidden_size, t.num_attention_heads, t.num_key_value_heads, t.head_dim
        self.compute_dtype = compute_dtype
        self.scale = h**-0.5
        self.q_kernel_dnh = param(rngs, (d, n, h), ("embed", "heads", "head_dim"), param_dtype)
        self.gate_kernel_dnh = param(rngs, (d, n, h), ("embed", "heads", "head_dim"), param_dtype)
        self.k_kernel_dkh = param(rngs, (d, kv, h), ("embed", "kv_heads", "head_dim"), param_dtype)
        self.v_kernel_dkh = param(rngs, (d, kv, h), ("embed", "kv_heads", "head_dim"), param_dtype)
        self.o_kernel_nhd = param(rngs, (n, h, d), ("heads", "head_dim", "embed"), param_dtype)
        self.q_norm = OffsetRMSNorm(h, t.rms_norm_eps, param_dtype=param_dtype)
        self.k_norm = OffsetRMSNorm(h, t.rms_norm_eps, param_dtype=param_dtype)

    def project(self, x_btd: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, ...]:
        """x [B, T, D] -> roped q [B, T, N, H], roped k, v [B, T, K, H], gate [B, T, N, H]."""
        cd = self.compute_dtype
        x = x_btd.astype(cd)
        q = constrain(jnp.einsum("btd,dnh->btnh", x, self.q_kernel_dnh[...].astype(cd)), ROWS_Q)
        gate = constrain(jnp.einsum("btd,dnh->btnh", x, self.gate_kernel_dnh[...].astype(cd)), ROWS_Q)
        k = constrain(jnp.einsum("btd,dkh->btkh", x, self.k_kernel_dkh[...].astype(cd)), ROWS_KV)
        v = constrain(jnp.einsum("btd,dkh->btkh", x, self.v_kernel_dkh[...].astype(cd)), ROWS_KV)
        q, k = self.q_norm(q), self.k_norm(k)
        return apply_partial_rotary(q, cos, sin), apply_partial_rotary(k, cos, sin), v, gate

    def output(self, o_btnh: jax.Array, gate_btnh: jax.Array) -> jax.Array:
        cd = self.compute_dtype
        o = constrain(o_btnh.astype(cd) * jax.nn.sigmoid(gate_btnh.astype(cd)), ROWS_Q)
        return constrain(jnp.einsum("btnh,nhd->btd", o, self.o_kernel_nhd[...].astype(cd)), ROWS_HIDDEN)

    def __call__(self, x_btd: jax.Array, cos: jax.Array, sin: jax.Array, mask: AttentionMask) -> jax.Array:
        q, k, v, gate = self.project(x_btd, cos, sin)
        return self.output(text_attention(q, k, v, mask, self.scale), gate)


class FullAttentionLayer(nnx.Module):
    """Pre-norm decoder layer with gated full attention and a SwiGLU MLP (`make_mlp(cfg, **kw)` builds another
    MLP in its place: Qwen3.5-MoE's routed experts)."""

    def __init__(self, cfg: Qwen3_5Config, *, rngs: nnx.Rngs, param_dtype: jnp.dtype, compute_dtype: jnp.dtype,
                 make_mlp: Callable[..., nnx.Module] = TextMLP):
        d, eps = cfg.text.hidden_size, cfg.text.rms_norm_eps
        self.input_norm = OffsetRMSNorm(d, eps, param_dtype=param_dtype)
        self.attn = GatedAttention(cfg, rngs=rngs, param_dtype=param_dtype, compute_dtype=compute_dtype)
        self.post_attn_norm = OffsetRMSNorm(d, eps, param_dtype=param_dtype)
        self.mlp = make_mlp(cfg, rngs=rngs, param_dtype=param_dtype, compute_dtype=compute_dtype)

    def mix(self, x_btd: jax.Array, cos: jax.Array, sin: jax.Array, mask: AttentionMask) -> jax.Array:
        """The token mixer with its residual: x + attention(norm(x))."""
        x_btd = constrain(x_btd, ROWS_HIDDEN)
        return x_btd + self.attn(self.input_norm(x_btd), cos, sin, mask)

    def __call__(self, x_btd: jax.Array, cos: jax.Array, sin: jax.Array, mask: AttentionMask) -> jax.Array:
        x = self.mix(x_btd, cos, sin, mask)
        return constrain(x + self.mlp(self.post_attn_norm(x)), ROWS_HIDDEN)


class LinearAttentionLayer(nnx.Module):
    """Pre-norm decoder layer with Gated DeltaNet and a SwiGLU MLP; every packed segment starts from zero state."""

    def __init__(self, cfg: Qwen3_5Config, *, rngs: nnx.Rngs, param_dtype: jnp.dtype, compute_dtype: jnp.dtype,
                 make_mlp: Callable[..., nnx.Module] = TextMLP):
        d, eps = cfg.text.hidden_size, cfg.text.rms_norm_eps
        self.input_norm = OffsetRMSNorm(d, eps, param_dtype=param_dtype)
        self.linear_attn = GatedDeltaNet(cfg, rngs=rngs, param_dtype=param_dtype, compute_dtype=compute_dtype)
        self.post_attn_norm = OffsetRMSNorm(d, eps, param_dtype=param_dtype)
        self.mlp = make_mlp(cfg, rngs=rngs, param_dtype=param_dtype, compute_dtype=compute_dtype)

    def mix(self, x_btd: jax.Array, cos: jax.Array, sin: jax.Array, mask: AttentionMask) -> jax.Array:
        """The token mixer with its residual: x + GatedDeltaNet(norm(x)), each segment from zero state."""
        x_btd = constrain(x_btd, ROWS_HIDDEN)
        seg = mask.segment_ids
        out, _ = self.linear_attn(self.input_norm(x_btd), segment_runs(seg),
                                  self.linear_attn.zero_state(x_btd.shape[0]), valid_bt=seg > 0)
        return x_btd + out

    def __call__(self, x_btd: jax.Array, cos: jax.Array, sin: jax.Array, mask: AttentionMask) -> jax.Array:
        x = self.mix(x_btd, cos, sin, mask)
        return constrain(x + self.mlp(self.post_attn_norm(x)), ROWS_HIDDEN)


LAYER_CLASSES = {"linear_attention": LinearAttentionLayer, "full_attention": FullAttentionLayer}


class Qwen3_5(nnx.Module):
    """Qwen3.5 for causal LM. `model(tokens [B, T], positions [3, B, T], segment_ids [B, T], vision) -> hidden
    [B, T, D]` after the final norm; `model.logits(hidden) -> [B, T, V]` fp32."""

    def __init__(
        self,
        cfg: Qwen3_5Config,
        *,
        rngs: nnx.Rngs,
        param_dtype: jnp.dtype = jnp.float32,
        compute_dtype: jnp.dtype = jnp.float32,
        remat: bool | str | RematPlan = False,
        attention_impl: str = "xla",
        patch_attention_block: int | None = None,
        make_mlp: Callable[..., nnx.Module] = TextMLP,
    ):
        """remat, attention_impl and patch_attention_block as for `Qwen3VL` (attention_impl applies to the
        full-attention layers and the vision tower; each decoder layer runs under the remat policy of its
        `text.layer_types` kind). make_mlp(cfg, **kw) builds every decoder layer's MLP (Qwen3.5-MoE passes its
        routed experts)."""
        if attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl={attention_impl!r} is not available; choose one of {ATTENTION_IMPLS}")
        if patch_attention_block is not None and patch_attention_block < 1:
            raise ValueError(f"patch_attention_block must be >= 1 or None, got {patch_attention_block}")
        t = cfg.text
        self.cfg = cfg
        self.compute_dtype = compute_dtype
        self.remat = RematPlan.of(remat)
        self.attention_impl = attention_impl
        kw = dict(rngs=rngs, param_dtype=param_dtype, compute_dtype=compute_dtype)
        self.embed_vd = param(rngs, (t.vocab_size, t.hidden_size), ("vocab", "embed"), param_dtype)
        self.layers = nnx.List([LAYER_CLASSES[kind](cfg, make_mlp=make_mlp, **kw) for kind in t.layer_types])
        self.final_norm = OffsetRMSNorm(t.hidden_size, t.rms_norm_eps, param_dtype=param_dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head_dv = param(rngs, (t.hidden_size, t.vocab_size), ("embed", "vocab"), param_dtype)
        self.visual = LearnedPositionVisionTower(cfg, remat=self.remat, attention_impl=attention_impl,
                                                 patch_attention_block=patch_attention_block, **kw)

    def lm_head_kernel(self) -> jax.Array:
        """Output projection [D, V] (the transposed embedding when tied)."""
        return self.embed_vd[...].T if self.cfg.tie_word_embeddings else self.lm_head_dv[...]

    def embed(self, tokens_bt: jax.Array) -> jax.Array:
        return constrain(jnp.take(self.embed_vd[...], tokens_bt, axis=0).astype(self.compute_dtype), ROWS_HIDDEN)

    def embed_inputs(self, tokens_bt: jax.Array, vision: Any) -> jax.Array:
        """Token embeddings [B, T, D] with the merged image features written at the image-pad slots."""
        b, t = tokens_bt.shape
        x = self.embed(tokens_bt)
        if vision is None:
            return x
        merged, _ = self.visual(vision)
        return constrain(set_at_slots(x, image_slots(vision, b, t), merged), ROWS_HIDDEN)

    def __call__(self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array, vision: Any = None) -> jax.Array:
        x = self.embed_inputs(tokens, vision)
        cos, sin = partial_mrope_cos_sin(positions, self.cfg.text, self.compute_dtype)
        mask = text_mask(segment_ids, self.attention_impl)
        for kind, layer in zip(self.cfg.text.layer_types, self.layers):
            x = remat_runner(run_block, self.remat.policy(kind))(layer, x, cos, sin, mask)
        return self.final_norm(x)

    def logits(self, hidden_btd: jax.Array) -> jax.Array:
        """Full-vocabulary logits [B, T, V] in fp32."""
        kernel = self.lm_head_kernel().astype(self.compute_dtype)
        return jnp.einsum("btd,dv->btv", hidden_btd.astype(self.compute_dtype), kernel, preferred_element_type=F32)


# ----------------------------------------------------------------------------- HF tensor names


def _conv_link(key: str, t: Qwen35TextConfig, me: ParamPath) -> Link:
    """conv1d.weight [C, 1, K] over q|k|v channels <-> our three tap arrays [K, heads, head_dim]."""
    kk, hk, hv, dk, dv = (t.linear_conv_kernel_dim, t.linear_num_key_heads, t.linear_num_value_heads,
                          t.linear_key_head_dim, t.linear_value_head_dim)
    sizes = (hk * dk, hk * dk, hv * dv)
    shapes = ((hk, dk), (hk, dk), (hv, dv))
    bounds = np.cumsum((0,) + sizes)

    def to_ours(w: np.ndarray) -> tuple[np.ndarray, ...]:
        return tuple(w[bounds[j] : bounds[j + 1], 0, :].T.reshape(kk, *shapes[j]) for j in range(3))

    def to_hf(xs: Any) -> np.ndarray:
        return np.concatenate([x.reshape(kk, -1).T for x in xs], axis=0)[:, None, :]

    paths = (me + ("conv_q_xhk",), me + ("conv_k_xhk",), me + ("conv_v_xhv",))
    return Link(key, (sum(sizes), 1, kk), paths, to_ours, to_hf)


def _qkv_link(key: str, t: Qwen35TextConfig, me: ParamPath) -> Link:
    """in_proj_qkv [2 Hk Dk + Hv Dv, D] <-> our q, k [D, Hk, Dk] and v [D, Hv, Dv] kernels."""
    d, hk, hv, dk, dv = t.hidden_size, t.linear_num_key_heads, t.linear_num_value_heads, t.linear_key_head_dim, t.linear_value_head_dim
    bounds = np.cumsum((0, hk * dk, hk * dk, hv * dv))
    shapes = ((hk, dk), (hk, dk), (hv, dv))

    def to_ours(w: np.ndarray) -> tuple[np.ndarray, ...]:
        return tuple(w[bounds[j] : bounds[j + 1]].T.reshape(d, *shapes[j]) for j in range(3))

    def to_hf(xs: Any) -> np.ndarray:
        return np.concatenate([x.reshape(d, -1).T for x in xs], axis=0)

    paths = (me + ("q_kernel_dhk",), me + ("k_kernel_dhk",), me + ("v_kernel_dhv",))
    return Link(key, (int(bounds[-1]), d), paths, to_ours, to_hf)


def _q_gate_link(key: str, n: int, h: int, d: int, me: ParamPath) -> Link:
    """q_proj [N * 2H, D], per head (query H, gate H) <-> our q and gate kernels [D, N, H]."""
    return Link(
        key,
        (n * 2 * h, d),
        (me + ("q_kernel_dnh",), me + ("gate_kernel_dnh",)),
        lambda w: tuple(w.reshape(n, 2, h, d)[:, j].transpose(2, 0, 1) for j in range(2)),
        lambda xs: np.stack([x.transpose(1, 2, 0) for x in xs], axis=1).reshape(n * 2 * h, d),
    )


def text_links(cfg: Qwen3_5Config) -> list[Link]:
    """The hybrid decoder's tensors (`model.language_model.*`, `lm_head`)."""
    t = cfg.text
    d, n, kv, h, f = t.hidden_size, t.num_attention_heads, t.num_key_value_heads, t.head_dim, t.intermediate_size
    hv, dv = t.linear_num_value_heads, t.linear_value_head_dim
    out: list[Link] = [copy_link("model.language_model.embed_tokens.weight", (t.vocab_size, d), ("embed_vd",))]
    for i, kind in enumerate(t.layer_types):
        hf = f"model.language_model.layers.{i}."
        me: ParamPath = ("layers", i)
        if kind == "full_attention":
            a = me + ("attn",)
            out += [
                _q_gate_link(hf + "self_attn.q_proj.weight", n, h, d, a),
                heads_in_link(hf + "self_attn.k_proj.weight", kv, h, d, a + ("k_kernel_dkh",)),
                heads_in_link(hf + "self_attn.v_proj.weight", kv, h, d, a + ("v_kernel_dkh",)),
                heads_out_link(hf + "self_attn.o_proj.weight", n, h, d, a + ("o_kernel_nhd",)),
                copy_link(hf + "self_attn.q_norm.weight", (h,), a + ("q_norm", "scale")),
                copy_link(hf + "self_attn.k_norm.weight", (h,), a + ("k_norm", "scale")),
            ]
        else:
            a, la = me + ("linear_attn",), hf + "linear_attn."
            out += [
                _qkv_link(la + "in_proj_qkv.weight", t, a),
                heads_in_link(la + "in_proj_z.weight", hv, dv, d, a + ("z_kernel_dhv",)),
                dense_link(la + "in_proj_b.weight", hv, d, a + ("b_kernel_dh",)),
                dense_link(la + "in_proj_a.weight", hv, d, a + ("a_kernel_dh",)),
                _conv_link(la + "conv1d.weight", t, a),
                copy_link(la + "A_log", (hv,), a + ("a_log_h",)),
                copy_link(la + "dt_bias", (hv,), a + ("dt_bias_h",)),
                copy_link(la + "norm.weight", (dv,), a + ("norm", "scale")),
                heads_out_link(la + "out_proj.weight", hv, dv, d, a + ("o_kernel_hvd",)),
            ]
        out += [
            dense_link(hf + "mlp.gate_proj.weight", f, d, me + ("mlp", "gate_kernel_df")),
            dense_link(hf + "mlp.up_proj.weight", f, d, me + ("mlp", "up_kernel_df")),
            dense_link(hf + "mlp.down_proj.weight", d, f, me + ("mlp", "down_kernel_fd")),
            copy_link(hf + "input_layernorm.weight", (d,), me + ("input_norm", "scale")),
            copy_link(hf + "post_attention_layernorm.weight", (d,), me + ("post_attn_norm", "scale")),
        ]
    out.append(copy_link("model.language_model.norm.weight", (d,), ("final_norm", "scale")))
    if not cfg.tie_word_embeddings:
        out.append(dense_link("lm_head.weight", t.vocab_size, d, ("lm_head_dv",)))
    return out


def weight_links(cfg: Qwen3_5Config) -> list[Link]:
    """Every tensor of `Qwen3_5ForConditionalGeneration` and where it lives in `Qwen3_5`."""
    return text_links(cfg) + learned_position_vision_links(cfg)


# ----------------------------------------------------------------------------- engine: hybrid cache


class SlotState(NamedTuple):
    """One slot's linear-layer state, as a small pytree: conv [L_lin, C, K-1], recurrent [L_lin, Hv, Dk, Dv] fp32."""

    conv: jax.Array
    recurrent: jax.Array


# Logical axes of the cache arrays (`sharding.rules` names): K/V pages split by kv heads as the attention
# projections are, recurrent state by value heads as the linear layers are; the conv window (q|k|v channels
# of mixed heads, K-1 steps) is small and replicated.
KV_AXES: tuple[str | None, ...] = (None, None, None, "kv_heads", "head_dim")
CONV_AXES: tuple[str | None, ...] = (None, None, None, None)
RECURRENT_AXES: tuple[str | None, ...] = (None, None, "linear_v_heads", "linear_head_dim", None)


@struct.dataclass
class HybridCache:
    """The engine's decode memory for Qwen3.5 (a `families.DecodeCache`).

    k, v [L_full, num_pages, page_size, kv_heads, head_dim]: paged K/V of the full-attention layers (in
      `cfg.text.full_layers` order), addressed by page tables as in `paged_kv`;
    conv [rows, L_lin, conv_dim, K-1]: per state row, the last K-1 pre-conv q|k|v inputs of each linear layer
      (transformers' conv_state layout);
    recurrent [rows, L_lin, Hv, Dk, Dv] fp32: per state row, each linear layer's delta-rule state.
    State rows are the running slots first, then whatever the engine keeps (prefix snapshots); a row holds the
    state after the last token its request prefilled or decoded, and does not grow with the context.
    """

    k: jax.Array
    v: jax.Array
    conv: jax.Array
    recurrent: jax.Array

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @property
    def state_rows(self) -> int:
        """Rows of per-request linear-layer state (`init_cache`'s max_slots)."""
        return self.conv.shape[0]

    def copy_page(self, src: jax.Array, dst: jax.Array) -> "HybridCache":
        """Page `src` copied into page `dst` in every full-attention layer (copy-on-write of a shared page)."""
        return self.replace(k=self.k.at[:, dst].set(self.k[:, src]), v=self.v.at[:, dst].set(self.v[:, src]))

    def copy_state(self, src: jax.Array, dst: jax.Array) -> "HybridCache":
        """State row `src` (conv and recurrent state of every linear layer) copied into row `dst`: a GRPO group's
        samples continue from the prompt's state, a snapshot is taken or restored; jit-able."""
        return self.replace(conv=self.conv.at[dst].set(self.conv[src]),
                            recurrent=self.recurrent.at[dst].set(self.recurrent[src]))

    def slot_state(self, row: jax.Array) -> SlotState:
        """State row `row` as a small pytree (to keep outside the cache); jit-able."""
        return SlotState(self.conv[row], self.recurrent[row])

    def with_slot_state(self, row: jax.Array, state: SlotState) -> "HybridCache":
        """The cache with `state` (from `slot_state`) written into state row `row`; jit-able."""
        return self.replace(conv=self.conv.at[row].set(state.conv.astype(self.conv.dtype)),
                            recurrent=self.recurrent.at[row].set(state.recurrent.astype(self.recurrent.dtype)))

    def logical_axes(self) -> "HybridCache":
        """Each array's logical axis names (how the engine shards the cache)."""
        return HybridCache(KV_AXES, KV_AXES, CONV_AXES, RECURRENT_AXES)


def init_cache(cfg: Qwen3_5Config, num_pages: int, page_size: int, max_slots: int, dtype: jnp.dtype) -> HybridCache:
    """Zeroed decode memory: `num_pages` pages of `page_size` positions for the full-attention layers and
    `max_slots` state rows for the linear layers (the engine asks for its slots plus its prefix snapshots; the
    recurrent state is fp32 whatever `dtype`)."""
    t = cfg.text
    kv = (len(t.full_layers), num_pages, page_size, t.num_key_value_heads, t.head_dim)
    lin = len(t.linear_layers)
    return HybridCache(
        k=jnp.zeros(kv, dtype),
        v=jnp.zeros(kv, dtype),
        conv=jnp.zeros((max_slots, lin, t.linear_conv_dim, t.linear_conv_kernel_dim - 1), dtype),
        recurrent=jnp.zeros((max_slots, lin, t.linear_num_value_heads, t.linear_key_head_dim, t.linear_value_head_dim), F32),
    )


def _run_layers(model: Qwen3_5, cache: HybridCache, x: jax.Array, cos: jax.Array, sin: jax.Array, write_kv: Any,
                attend: CacheAttention, load: Any, store: Any, valid_bt: jax.Array | None,
                length: jax.Array | None) -> tuple[HybridCache, jax.Array, list[jax.Array]]:
    """The decoder against the cache, shared by prefill and decode: a full layer writes its K/V (`write_kv`) and
    attends to its pages (`attend`, given its index among the full layers); a linear layer runs from
    `load(cache, j)` and `store`s its new state. Returns the cache (its other fields, e.g. Qwen3.5-MoE's expert
    ids, untouched), the final-normed hidden states and the top-k expert ids [B, T, k] of each layer whose MLP is
    a routed `SparseMoE` (in layer order)."""
    k_all, v_all, conv_all, rec_all = cache.k, cache.v, cache.conv, cache.recurrent
    kinds = model.cfg.text.layer_types
    routed: list[jax.Array] = []
    fi = li = 0
    for layer, kind in zip(model.layers, kinds):
        h = layer.input_norm(x)
        if kind == "full_attention":
            q, k, v, gate = layer.attn.project(h, cos, sin)
            k_all, v_all = write_kv(k_all, fi, k.astype(k_all.dtype)), write_kv(v_all, fi, v.astype(v_all.dtype))
            x = x + layer.attn.output(attend(q, k_all, v_all, fi, layer.attn.scale), gate)
            fi += 1
        else:
            run = jnp.zeros(x.shape[:2], jnp.int32)
            out, state = layer.linear_attn(h, run, load(conv_all, rec_all, li), valid_bt, length)
            conv_all, rec_all = store(conv_all, rec_all, li, state)
            x = x + out
            li += 1
        if isinstance(layer.mlp, SparseMoE):
            y, routing = layer.mlp.forward(layer.post_attn_norm(x))
            routed.append(routing.topk_ids)
            x = x + y
        else:
            x = x + layer.mlp(layer.post_attn_norm(x))
    return cache.replace(k=k_all, v=v_all, conv=conv_all, recurrent=rec_all), model.final_norm(x), routed


def _lm_logits(model: Qwen3_5, hidden_nd: jax.Array) -> jax.Array:
    kernel = model.lm_head_kernel().astype(model.compute_dtype)
    return jnp.einsum("nd,dv->nv", hidden_nd.astype(model.compute_dtype), kernel, preferred_element_type=F32)


def prefill(
    model: Qwen3_5,
    cache: HybridCache,
    slot: jax.Array,
    table_p: jax.Array,
    start: jax.Array,
    tokens_1t: jax.Array,
    positions_31t: jax.Array,
    length: jax.Array,
    vision: Any,
) -> tuple[HybridCache, jax.Array]:
    """`prefill_routed` without the expert ids."""
    return prefill_routed(model, cache, slot, table_p, start, tokens_1t, positions_31t, length, vision)[:2]


def prefill_routed(
    model: Qwen3_5,
    cache: HybridCache,
    slot: jax.Array,
    table_p: jax.Array,
    start: jax.Array,
    tokens_1t: jax.Array,
    positions_31t: jax.Array,
    length: jax.Array,
    vision: Any,
) -> tuple[HybridCache, jax.Array, list[jax.Array]]:
    """Prompt tokens [start, start + T) of the request in `slot` into the cache; arguments as `paged_kv.prefill`.

    Full-attention layers write K/V at those positions of `table_p` and attend to [0, start + i]. Linear layers
    start from the slot's stored conv / recurrent state when start > 0 (it must be the state after token
    start - 1: the slot's own earlier prefill, or one restored with `with_slot_state` / `copy_state`), from zero
    when start = 0, and store the state after the last real token (start + length - 1) back into the slot; the
    padding after `length` changes nothing. Returns the cache, the fp32 logits [V] at the last real token and each
    routed MoE layer's top-k expert ids [1, T, k] (`_run_layers`; none for Qwen3.5's dense MLPs)."""
    _, t = tokens_1t.shape
    num_pages, page_size = cache.k.shape[1], cache.k.shape[2]
    x = model.embed_inputs(tokens_1t, vision)
    cos, sin = partial_mrope_cos_sin(positions_31t, model.cfg.text, model.compute_dtype)
    span = table_p.shape[0] * page_size
    mask = (jnp.arange(span)[None, :] <= (start + jnp.arange(t))[:, None])[None]
    page_t, row_t = page_slots(table_p, start + jnp.arange(t), page_size, num_pages)
    keep = start > 0

    def write_kv(part: jax.Array, i: int, new: jax.Array) -> jax.Array:
        return part.at[i, page_t, row_t].set(new[0], mode="drop")

    def load(conv_all: jax.Array, rec_all: jax.Array, j: int) -> LinearState:
        conv = jnp.where(keep, conv_all[slot, j], 0).astype(model.compute_dtype)
        return LinearState(jnp.swapaxes(conv, 0, 1)[None], jnp.where(keep, rec_all[slot, j], 0.0)[None])

    def store(conv_all: jax.Array, rec_all: jax.Array, j: int, s: LinearState) -> tuple[jax.Array, jax.Array]:
        conv_all = conv_all.at[slot, j].set(jnp.swapaxes(s.conv[0], 0, 1).astype(conv_all.dtype), mode="drop")
        return conv_all, rec_all.at[slot, j].set(s.recurrent[0], mode="drop")

    valid = (jnp.arange(t) < length)[None]
    attend = gather_attention(mask, table_p[None])
    cache, hidden, routed = _run_layers(model, cache, x, cos, sin, write_kv, attend, load, store, valid, length)
    last = jax.lax.dynamic_slice_in_dim(hidden[0], length - 1, 1, axis=0)
    return cache, _lm_logits(model, last)[0], routed


def decode(
    model: Qwen3_5,
    cache: HybridCache,
    slots_b: jax.Array,
    tables_bp: jax.Array,
    tokens_b: jax.Array,
    lengths_b: jax.Array,
    rope_deltas_b: jax.Array,
) -> tuple[HybridCache, jax.Array]:
    """`decode_routed` without the expert ids."""
    return decode_routed(model, cache, slots_b, tables_bp, tokens_b, lengths_b, rope_deltas_b)[:2]


def decode_routed(
    model: Qwen3_5,
    cache: HybridCache,
    slots_b: jax.Array,
    tables_bp: jax.Array,
    tokens_b: jax.Array,
    lengths_b: jax.Array,
    rope_deltas_b: jax.Array,
) -> tuple[HybridCache, jax.Array, list[jax.Array]]:
    """One decode step of the requests in `slots_b` [B] (arguments as `paged_kv.decode`): full-attention layers
    append K/V and attend to their pages, linear layers take one recurrent step from their slot's state and store
    it back. Padding rows are those whose table starts with num_pages (a running request always has a first
    page), as `paged_kv.decode` has them: whatever slot they carry (the engine pads with 0), their state writes
    are dropped, so they never touch a running slot. Returns the cache, fp32 logits [B, V] and each routed MoE
    layer's top-k expert ids [B, 1, k]."""
    b = tokens_b.shape[0]
    num_pages, page_size = cache.k.shape[1], cache.k.shape[2]
    x = model.embed(tokens_b[:, None])
    pos = (lengths_b + rope_deltas_b)[None, :, None]
    cos, sin = partial_mrope_cos_sin(jnp.broadcast_to(pos, (3, b, 1)), model.cfg.text, model.compute_dtype)
    page_b, row_b = page_slots(tables_bp, lengths_b[:, None], page_size, num_pages)
    rows = cache.conv.shape[0]
    slots = jnp.clip(slots_b, 0, rows - 1)  # reads
    write_rows = jnp.where(tables_bp[:, 0] < num_pages, slots, rows)  # padding rows write nowhere

    def write_kv(part: jax.Array, i: int, new: jax.Array) -> jax.Array:
        return part.at[i, page_b[:, 0], row_b[:, 0]].set(new[:, 0], mode="drop")

    def load(conv_all: jax.Array, rec_all: jax.Array, j: int) -> LinearState:
        return LinearState(jnp.swapaxes(conv_all[slots, j], 1, 2).astype(model.compute_dtype), rec_all[slots, j])

    def store(conv_all: jax.Array, rec_all: jax.Array, j: int, s: LinearState) -> tuple[jax.Array, jax.Array]:
        conv_all = conv_all.at[write_rows, j].set(jnp.swapaxes(s.conv, 1, 2).astype(conv_all.dtype), mode="drop")
        return conv_all, rec_all.at[write_rows, j].set(s.recurrent, mode="drop")

    attend = decode_attention(model.attention_impl, tables_bp, lengths_b, page_size)
    cache, hidden, routed = _run_layers(model, cache, x, cos, sin, write_kv, attend, load, store, None, None)
    return cache, _lm_logits(model, hidden[:, 0]), routed


def init_std(path: tuple[Any, ...], shape: tuple[int, ...], cfg: Qwen3_5Config) -> float | None:
    """The tiny model's init of the parameters the generic rule (`tiny.py`) does not name: conv taps scaled by
    their fan-in (the K taps of one channel); A_log keeps its constructor value (0: A = 1)."""
    leaf = str(path[-1])
    if leaf.startswith("conv_"):
        return shape[0] ** -0.5
    if leaf == "a_log_h":
        return None
    raise ValueError(f"no init rule for qwen3_5 parameter {'.'.join(map(str, path))} {shape}")


# Released checkpoints carry a multi-token-prediction head (`mtp.fc`, `mtp.layers.*`, `mtp.norm`, ...) that
# transformers' Qwen3.5 classes skip on load (`_keys_to_ignore_on_load_unexpected`); so does our import.
IGNORED_CHECKPOINT_KEYS = (r"^mtp.*",)

FAMILY_MODEL = FamilyModel(
    model_class=Qwen3_5,
    weight_links=weight_links,
    init_cache=init_cache,
    prefill=prefill,
    decode=decode,
    init_std=init_std,
    ignored_checkpoint_keys=IGNORED_CHECKPOINT_KEYS,
)
