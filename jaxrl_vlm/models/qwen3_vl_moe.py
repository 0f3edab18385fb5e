"""Qwen3-VL-MoE (Qwen3-VL's vision tower with deepstack, Qwen3-VL's text decoder with routed sparse MoE MLPs) in
plain Flax NNX.

Semantics follow transformers' `modeling_qwen3_vl_moe.py` (5.24). A decoder layer is Qwen3-VL's (pre-RMSNorm, GQA
with q/k norm and interleaved M-RoPE) whose MLP is `moe.SparseMoE` in the sparse layers
(`cfg.text.sparse_layers`: not in `mlp_only_layers` and (i + 1) % decoder_sparse_step == 0) and Qwen3-VL's SwiGLU
MLP in the others. The vision tower is the shared `layers.LearnedPositionVisionTower` and its HF names the shared
`hf_links.learned_position_vision_links`.

`Qwen3VLMoe` is a `PolicyModel`; `forward` also returns the routing of every sparse layer (router logits, top-k ids
and weights, stacked [L_sparse, B, T, ...]) and takes forced top-k ids (routing replay), so a train step can add
`moe.load_balancing_loss` and log `moe.expert_load`. The engine runs it on the paged KV cache with `paged_kv`'s
functions unchanged: they use each layer's `mlp`, which is the MoE block here.

HF tensors (transformers 5 names and layout, which `save_pretrained` writes): per sparse layer `mlp.gate.weight`
[E, D] (router), `mlp.experts.gate_up_proj` [E, 2F, D] (gate rows then up rows) and `mlp.experts.down_proj`
[E, D, F]. Released checkpoints store the two expert tensors transposed ([E, D, 2F], [E, F, D]) and transformers
transposes them at load time; so does our reader (`Link.stored_layouts`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_vlm.models import paged_kv
from jaxrl_vlm.models.activation_sharding import ROWS_HIDDEN, constrain
from jaxrl_vlm.models.config import Qwen3VLMoeConfig
from jaxrl_vlm.models.families import FamilyModel
from jaxrl_vlm.models.hf_links import Link, ParamPath, dense_link, learned_position_vision_links, text_decoder_links
from jaxrl_vlm.models.layers import (
    AttentionMask,
    LearnedPositionVisionTower,
    RMSNorm,
    TextAttention,
    TextMLP,
    VisionLanguageDecoder,
    add_at_slots,
    mrope_cos_sin,
    remat_runner,
    text_mask,
)
from jaxrl_vlm.models.moe import Routing, SparseMoE
from jaxrl_vlm.models.remat import RematPlan


class MoeDecoderLayer(nnx.Module):
    """Qwen3-VL's pre-norm decoder layer with a routed MoE MLP (`sparse`) or the dense SwiGLU MLP. The attribute
    names are `layers.DecoderLayer`'s, so `paged_kv`'s prefill and decode run it as they run Qwen3-VL's."""

    def __init__(self, cfg: Qwen3VLMoeConfig, sparse: bool, *, rngs: nnx.Rngs, param_dtype: jnp.dtype,
                 compute_dtype: jnp.dtype):
        t = cfg.text
        kw = dict(rngs=rngs, param_dtype=param_dtype, compute_dtype=compute_dtype)
        self.sparse = sparse
        self.input_norm = RMSNorm(t.hidden_size, t.rms_norm_eps, param_dtype=param_dtype)
        self.attn = TextAttention(cfg, **kw)
        self.post_attn_norm = RMSNorm(t.hidden_size, t.rms_norm_eps, param_dtype=param_dtype)
        self.mlp = SparseMoE(t, **kw) if sparse else TextMLP(cfg, **kw)

    def forward(self, x_btd: jax.Array, cos: jax.Array, sin: jax.Array, mask: AttentionMask,
                forced_topk_ids: jax.Array | None = None) -> tuple[jax.Array, Routing | None]:
        """x [B, T, D] -> (x [B, T, D], the MoE block's `Routing` [B, T, ...] or None in a dense layer)."""
        x_btd = constrain(x_btd, ROWS_HIDDEN)
        x = x_btd + self.attn(self.input_norm(x_btd), cos, sin, mask)
        h = self.post_attn_norm(x)
        if not self.sparse:
            return constrain(x + self.mlp(h), ROWS_HIDDEN), None
        y, routing = self.mlp.forward(h, forced_topk_ids)
        return constrain(x + y, ROWS_HIDDEN), routing

    def __call__(self, x_btd: jax.Array, cos: jax.Array, sin: jax.Array, mask: AttentionMask) -> jax.Array:
        return self.forward(x_btd, cos, sin, mask)[0]


def run_moe_layer(layer: MoeDecoderLayer, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: AttentionMask,
                  forced: jax.Array | None) -> tuple[jax.Array, Routing | None]:
    return layer.forward(x, cos, sin, mask, forced)




class Qwen3VLMoe(VisionLanguageDecoder):
    """Qwen3-VL-MoE for causal LM. `model(tokens [B, T], positions [3, B, T], segment_ids [B, T], vision) -> hidden
    [B, T, D]` after the final norm; `model.forward(..., routed_experts)` -> (hidden, `Routing` stacked over the
    sparse layers or None); `model.logits(hidden) -> [B, T, V]` fp32. Embedding, image-token scatter, deepstack,
    final norm and LM head are `VisionLanguageDecoder`'s."""

    def __init__(
        self,
        cfg: Qwen3VLMoeConfig,
        *,
        rngs: nnx.Rngs,
        param_dtype: jnp.dtype = jnp.float32,
        compute_dtype: jnp.dtype = jnp.float32,
        remat: bool | str | RematPlan = False,
        attention_impl: str = "xla",
        patch_attention_block: int | None = None,
    ):
        """remat, attention_impl and patch_attention_block as for `Qwen3VL`; sparse layers run under the remat
        plan's `moe` policy, the dense ones under `full_attention`."""
        super().__init__(cfg, LearnedPositionVisionTower, rngs=rngs, param_dtype=param_dtype,
                         compute_dtype=compute_dtype, remat=remat, attention_impl=attention_impl,
                         patch_attention_block=patch_attention_block,
                         make_layer=lambda cfg, i, **kw: MoeDecoderLayer(cfg, cfg.text.is_sparse(i), **kw))

    def forward(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        vision: Any = None,
        routed_experts: jax.Array | None = None,
    ) -> tuple[jax.Array, Routing | None]:
        """(hidden [B, T, D] after the final norm, Routing with arrays [L_sparse, B, T, ...] or None without sparse
        layers). routed_experts: int [L_sparse, B, T, k] top-k ids to use instead of the router's choice (routing
        replay; sparse layers in `cfg.text.sparse_layers` order), or None."""
        x, deepstack, slots = self.embed_inputs(tokens, vision)
        cos, sin = mrope_cos_sin(positions, self.cfg, self.compute_dtype)
        mask = text_mask(segment_ids, self.attention_impl)
        routings: list[Routing] = []
        for i, layer in enumerate(self.layers):
            forced = None if routed_experts is None or not layer.sparse else routed_experts[len(routings)]
            run = remat_runner(run_moe_layer, self.remat.moe if layer.sparse else self.remat.full_attention)
            x, routing = run(layer, x, cos, sin, mask, forced)
            if routing is not None:
                routings.append(routing)
            if i < len(deepstack):
                x = add_at_slots(x, slots, deepstack[i])
        stacked = Routing(*(jnp.stack(parts) for parts in zip(*routings))) if routings else None
        return self.final_norm(x), stacked

    def __call__(self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array, vision: Any = None) -> jax.Array:
        return self.forward(tokens, positions, segment_ids, vision)[0]


# ----------------------------------------------------------------------------- HF tensor names


def expert_links(hf: str, me: ParamPath, e: int, d: int, f: int) -> list[Link]:
    """One sparse layer's MoE block: router `gate.weight` [E, D] and the stacked experts, `experts.gate_up_proj`
    [E, 2F, D] (rows: F of gate, then F of up) and `experts.down_proj` [E, D, F] (transformers 5's layout)."""
    return [
        dense_link(hf + "gate.weight", e, d, me + ("router_kernel_de",)),
        Link(
            hf + "experts.gate_up_proj",
            (e, 2 * f, d),
            (me + ("gate_experts_edf",), me + ("up_experts_edf",)),
            lambda w: (w[:, :f].transpose(0, 2, 1), w[:, f:].transpose(0, 2, 1)),
            lambda xs: np.concatenate([x.transpose(0, 2, 1) for x in xs], axis=1),
            stored_layouts=(((e, d, 2 * f), lambda w: w.transpose(0, 2, 1)),),  # released checkpoints
        ),
        Link(
            hf + "experts.down_proj",
            (e, d, f),
            (me + ("down_experts_efd",),),
            lambda w: (w.transpose(0, 2, 1),),
            lambda xs: xs[0].transpose(0, 2, 1),
            stored_layouts=(((e, f, d), lambda w: w.transpose(0, 2, 1)),),  # released checkpoints
        ),
    ]


def text_links(cfg: Qwen3VLMoeConfig) -> list[Link]:
    """The text decoder's tensors: Qwen3-VL's (`hf_links.text_decoder_links`), with each sparse layer's dense MLP
    tensors replaced by its MoE block's, in place."""
    t = cfg.text
    sparse = set(t.sparse_layers)
    out: list[Link] = []
    for link in text_decoder_links(cfg):
        parts = link.hf_key.split(".")  # model.language_model.layers.{i}.mlp.{gate,up,down}_proj.weight
        if parts[2:3] == ["layers"] and parts[4] == "mlp" and int(parts[3]) in sparse:
            if parts[5] == "gate_proj":  # the first of the three: the MoE block goes here
                hf, me = ".".join(parts[:5]) + ".", ("layers", int(parts[3]), "mlp")
                out += expert_links(hf, me, t.num_experts, t.hidden_size, t.moe_intermediate_size)
            continue
        out.append(link)
    return out


def weight_links(cfg: Qwen3VLMoeConfig) -> list[Link]:
    """Every tensor of `Qwen3VLMoeForConditionalGeneration` and where it lives in `Qwen3VLMoe`."""
    return text_links(cfg) + learned_position_vision_links(cfg)


def init_std(path: tuple[Any, ...], shape: tuple[int, ...], cfg: Qwen3VLMoeConfig) -> float | None:
    """The tiny model's init of the stacked expert kernels (the generic rule in `tiny.py` takes a kernel's first
    axis as its fan-in; here it is the second, after the expert axis): N(0, 1/fan_in), the down projection further
    divided by sqrt(2 * layers) as every residual-branch output."""
    leaf = str(path[-1])
    if leaf in ("gate_experts_edf", "up_experts_edf"):
        return shape[1] ** -0.5
    if leaf == "down_experts_efd":
        return shape[1] ** -0.5 / np.sqrt(2 * cfg.text.num_hidden_layers)
    raise ValueError(f"no init rule for qwen3_vl_moe parameter {'.'.join(map(str, path))} {shape}")


# ----------------------------------------------------------------------------- engine: paged K/V + routed experts


class MoeKVCache(NamedTuple):
    """`paged_kv.KVCache` plus the experts each cached position was routed to: experts int32 [num_pages,
    page_size, num_hidden_layers, k] (-1 in dense layers). Stored by page like the K/V, as SGLang keeps them by KV
    slot: a reused prefix brings the routing its first request computed, and copy-on-write copies it."""

    k: jax.Array
    v: jax.Array
    experts: jax.Array

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @property
    def state_rows(self) -> int:
        return 0

    def copy_page(self, src: jax.Array, dst: jax.Array) -> "MoeKVCache":
        kv = paged_kv.KVCache(self.k, self.v).copy_page(src, dst)
        return MoeKVCache(kv.k, kv.v, self.experts.at[dst].set(self.experts[src]))

    def copy_state(self, src: jax.Array, dst: jax.Array) -> "MoeKVCache":
        return self

    def logical_axes(self) -> "MoeKVCache":
        return MoeKVCache(paged_kv.KV_LOGICAL_AXES, paged_kv.KV_LOGICAL_AXES, (None, None, None, None))

    def routed_experts(self, pages: jax.Array, n: int) -> jax.Array:
        """int32 [n, num_hidden_layers, k]: the experts of positions [0, n) of the request with page table
        `pages` [P] (SGLang's `routed_experts` layout)."""
        rows = self.experts[pages]
        return rows.reshape(-1, *rows.shape[2:])[:n]


def init_cache(cfg: Qwen3VLMoeConfig, num_pages: int, page_size: int, max_slots: int, dtype: jnp.dtype) -> MoeKVCache:
    kv = paged_kv.init_cache(cfg, num_pages, page_size, max_slots, dtype)
    shape = (num_pages, page_size, cfg.text.num_hidden_layers, cfg.text.num_experts_per_tok)
    return MoeKVCache(kv.k, kv.v, jnp.full(shape, -1, jnp.int32))


def _store(cache: MoeKVCache, kv: paged_kv.KVCache, routed: list[jax.Array], sparse: tuple[int, ...], page: jax.Array,
           row: jax.Array) -> MoeKVCache:
    """The new K/V, with the sparse layers' ids [N, k] of the positions at (page, row) [N] written where their
    K/V went (writes to page num_pages are dropped)."""
    if not routed:
        return MoeKVCache(kv.k, kv.v, cache.experts)
    ids = jnp.stack([r.reshape(-1, r.shape[-1]) for r in routed], axis=1)  # [N, L_sparse, k]
    layers = jnp.asarray(sparse, jnp.int32)
    experts = cache.experts.at[page[:, None], row[:, None], layers[None, :]].set(ids, mode="drop")
    return MoeKVCache(kv.k, kv.v, experts)


def prefill(model: Qwen3VLMoe, cache: MoeKVCache, slot: jax.Array, table_p: jax.Array, start: jax.Array,
            tokens_1t: jax.Array, positions_31t: jax.Array, length: jax.Array, vision: Any) -> tuple[MoeKVCache, jax.Array]:
    """`prefill_rows` of one request."""
    cache, logits = prefill_rows(model, cache, table_p[None], start[None], tokens_1t, positions_31t, length[None], vision)
    return cache, logits[0]


def prefill_rows(model: Qwen3VLMoe, cache: MoeKVCache, tables_rp: jax.Array, starts_r: jax.Array, tokens_rt: jax.Array,
                 positions_3rt: jax.Array, lengths_r: jax.Array, vision: Any) -> tuple[MoeKVCache, jax.Array]:
    """`paged_kv.prefill_rows`, recording each prompt position's experts next to its K/V."""
    kv, logits, routed = paged_kv.prefill_rows_routed(model, paged_kv.KVCache(cache.k, cache.v), tables_rp, starts_r,
                                                      tokens_rt, positions_3rt, lengths_r, vision)
    t = tokens_rt.shape[1]
    page, row = paged_kv.page_slots(tables_rp, starts_r[:, None] + jnp.arange(t)[None, :], cache.page_size,
                                    cache.num_pages)
    return _store(cache, kv, routed, model.cfg.text.sparse_layers, page.reshape(-1), row.reshape(-1)), logits


def decode(model: Qwen3VLMoe, cache: MoeKVCache, slots_b: jax.Array, tables_bp: jax.Array, tokens_b: jax.Array,
           lengths_b: jax.Array, rope_deltas_b: jax.Array) -> tuple[MoeKVCache, jax.Array]:
    """`paged_kv.decode`, recording the experts of each row's input token (position lengths_b)."""
    kv, logits, routed = paged_kv.decode_routed(model, paged_kv.KVCache(cache.k, cache.v), slots_b, tables_bp,
                                                tokens_b, lengths_b, rope_deltas_b)
    page, row = paged_kv.page_slots(tables_bp, lengths_b[:, None], cache.page_size, cache.num_pages)
    return _store(cache, kv, routed, model.cfg.text.sparse_layers, page[:, 0], row[:, 0]), logits


FAMILY_MODEL = FamilyModel(
    model_class=Qwen3VLMoe,
    weight_links=weight_links,
    init_cache=init_cache,
    prefill=prefill,
    decode=decode,
    init_std=init_std,
    prefill_rows=prefill_rows,
)
