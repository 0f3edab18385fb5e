"""Qwen3.5-MoE (Qwen3.5's hybrid Gated DeltaNet / gated attention decoder whose MLPs are routed experts plus a gated
shared expert, Qwen3.5's vision tower) in plain Flax NNX.

Semantics follow transformers' `modeling_qwen3_5_moe.py` (5.24), which derives the family from Qwen3.5 exactly so:
the decoder layers are Qwen3.5's (`qwen3_5.LinearAttentionLayer` / `FullAttentionLayer`, 3 linear : 1 full), each
with `SharedExpertMoE` as its MLP, in every layer:

    y = sum_{j<k} w_j * expert_{e_j}(x) + sigmoid(x . g) * shared_expert(x)

- routed experts: `moe.SparseMoE` (router logits x @ W_router, softmax in fp32, top-k by probability, the k
  probabilities renormalised to sum to 1; SwiGLU experts of width `moe_intermediate_size`, grouped `ragged_dot`);
- shared expert: a SwiGLU MLP of width `shared_expert_intermediate_size` (`layers.TextMLP`; our config keeps that
  width as `text.intermediate_size`) applied to every token, scaled by a per-token sigmoid gate `shared_expert_gate`
  [D -> 1].

This file builds on Qwen3.5's (layers, vision tower, HybridCache engine functions, HF links of the hybrid stack), as
transformers' modular file does; Qwen3.5's layers take the MLP as `make_mlp` and expose their token mixer (`mix`).
`Qwen3_5Moe` is a `PolicyModel`; `forward` also returns the routing of every layer (router logits, top-k ids and
weights, stacked [L, B, T, ...]) and takes forced top-k ids (routing replay), as `Qwen3VLMoe` does. The engine runs
it with Qwen3.5's `prefill_routed` / `decode_routed` on `MoeHybridCache` (Qwen3.5's `HybridCache` plus each
position's expert ids by page, for `return_routed_experts`).

HF tensors per layer (transformers 5's parameter names, and the layout released checkpoints store):
`mlp.gate.weight` [E, D] (router), `mlp.experts.gate_up_proj` [E, 2F, D] (gate rows then up rows),
`mlp.experts.down_proj` [E, D, F], `mlp.shared_expert.{gate,up,down}_proj.weight`, `mlp.shared_expert_gate.weight`
[1, D]. transformers' `save_pretrained` writes the experts one by one instead (`mlp.experts.{e}.gate_proj.weight`,
`up_proj`, `down_proj`, torch Linear layouts) and reads both, as SGLang and vLLM do; `hf_io` reads both
(`Link.stored_splits`) and writes the fused form. Checkpoints' multi-token-prediction head (`mtp.*`) is skipped.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jaxrl_vlm.models import qwen3_5
from jaxrl_vlm.models.activation_sharding import ROWS_HIDDEN, constrain
from jaxrl_vlm.models.config import Qwen3_5MoeConfig, Qwen35MoeTextConfig
from jaxrl_vlm.models.families import FamilyModel
from jaxrl_vlm.models.hf_links import Link, ParamPath, dense_link, per_expert_split
from jaxrl_vlm.models.layers import AttentionMask, TextMLP, param, remat_runner, text_mask
from jaxrl_vlm.models.moe import Routing, SparseMoE
from jaxrl_vlm.models.paged_kv import page_slots
from jaxrl_vlm.models.remat import RematPlan


class SharedExpertMoE(SparseMoE):
    """transformers' `Qwen3_5MoeSparseMoeBlock`: the routed experts of `SparseMoE` plus a shared SwiGLU expert
    (`shared`, width `text.intermediate_size`) whose output each token scales by sigmoid(x . shared_gate).

    `block(x [B, T, D]) -> [B, T, D]` (the decoder's MLP slot); `block.forward(x, forced_topk_ids) -> (y, Routing)`."""

    def __init__(self, cfg: Qwen3_5MoeConfig, *, rngs: nnx.Rngs, param_dtype: jnp.dtype, compute_dtype: jnp.dtype):
        super().__init__(cfg.text, rngs=rngs, param_dtype=param_dtype, compute_dtype=compute_dtype)
        self.shared = TextMLP(cfg, rngs=rngs, param_dtype=param_dtype, compute_dtype=compute_dtype)
        self.shared_gate_kernel_d1 = param(rngs, (cfg.text.hidden_size, 1), ("embed", None), param_dtype)

    def forward(self, x_btd: jax.Array, forced_topk_ids: jax.Array | None = None) -> tuple[jax.Array, Routing]:
        routed, routing = super().forward(x_btd, forced_topk_ids)
        cd = self.compute_dtype
        x = x_btd.astype(cd)
        gate = jax.nn.sigmoid(jnp.einsum("btd,dg->btg", x, self.shared_gate_kernel_d1[...].astype(cd)))
        return constrain(routed + gate * self.shared(x), ROWS_HIDDEN), routing


def run_moe_layer(layer: nnx.Module, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: AttentionMask,
                  forced: jax.Array | None) -> tuple[jax.Array, Routing]:
    """One decoder layer (either kind): its token mixer, then the MoE MLP; (x [B, T, D], Routing [B, T, ...])."""
    x = layer.mix(x, cos, sin, mask)
    y, routing = layer.mlp.forward(layer.post_attn_norm(x), forced)
    return constrain(x + y, ROWS_HIDDEN), routing


class Qwen3_5Moe(qwen3_5.Qwen3_5):
    """Qwen3.5-MoE for causal LM. `model(tokens [B, T], positions [3, B, T], segment_ids [B, T], vision) -> hidden
    [B, T, D]` after the final norm; `model.forward(..., routed_experts)` -> (hidden, `Routing` stacked over the
    layers); `model.logits(hidden) -> [B, T, V]` fp32. Embedding, image scatter, final norm, LM head and tower are
    Qwen3.5's."""

    def __init__(
        self,
        cfg: Qwen3_5MoeConfig,
        *,
        rngs: nnx.Rngs,
        param_dtype: jnp.dtype = jnp.float32,
        compute_dtype: jnp.dtype = jnp.float32,
        remat: bool | str | RematPlan = False,
        attention_impl: str = "xla",
        patch_attention_block: int | None = None,
    ):
        """As `Qwen3_5`; every decoder layer has a routed MoE MLP, so all run under the remat plan's `moe` policy."""
        super().__init__(cfg, rngs=rngs, param_dtype=param_dtype, compute_dtype=compute_dtype, remat=remat,
                         attention_impl=attention_impl, patch_attention_block=patch_attention_block,
                         make_mlp=SharedExpertMoE)

    def forward(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        vision: Any = None,
        routed_experts: jax.Array | None = None,
    ) -> tuple[jax.Array, Routing]:
        """(hidden [B, T, D] after the final norm, Routing with arrays [L, B, T, ...]). routed_experts: int
        [L, B, T, k] top-k ids to use instead of the router's choice (routing replay; a row of negative ids keeps
        the router's), or None."""
        x = self.embed_inputs(tokens, vision)
        cos, sin = qwen3_5.partial_mrope_cos_sin(positions, self.cfg.text, self.compute_dtype)
        mask = text_mask(segment_ids, self.attention_impl)
        run = remat_runner(run_moe_layer, self.remat.moe)
        routings: list[Routing] = []
        for i, layer in enumerate(self.layers):
            x, routing = run(layer, x, cos, sin, mask, None if routed_experts is None else routed_experts[i])
            routings.append(routing)
        return self.final_norm(x), Routing(*(jnp.stack(parts) for parts in zip(*routings)))

    def __call__(self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array, vision: Any = None) -> jax.Array:
        return self.forward(tokens, positions, segment_ids, vision)[0]


# ----------------------------------------------------------------------------- HF tensor names


def moe_links(hf: str, me: ParamPath, t: Qwen35MoeTextConfig) -> list[Link]:
    """One layer's router, shared-expert gate and stacked routed experts (`hf` ends in `mlp.`, `me` is the block)."""
    e, d, f = t.num_experts, t.hidden_size, t.moe_intermediate_size
    return [
        dense_link(hf + "gate.weight", e, d, me + ("router_kernel_de",)),
        dense_link(hf + "shared_expert_gate.weight", 1, d, me + ("shared_gate_kernel_d1",)),
        Link(
            hf + "experts.gate_up_proj",
            (e, 2 * f, d),
            (me + ("gate_experts_edf",), me + ("up_experts_edf",)),
            lambda w: (w[:, :f].transpose(0, 2, 1), w[:, f:].transpose(0, 2, 1)),
            lambda xs: np.concatenate([x.transpose(0, 2, 1) for x in xs], axis=1),
            stored_splits=(per_expert_split(hf + "experts.", ("gate_proj", "up_proj"), e, (f, d)),),
        ),
        Link(
            hf + "experts.down_proj",
            (e, d, f),
            (me + ("down_experts_efd",),),
            lambda w: (w.transpose(0, 2, 1),),
            lambda xs: xs[0].transpose(0, 2, 1),
            stored_splits=(per_expert_split(hf + "experts.", ("down_proj",), e, (d, f)),),
        ),
    ]


def weight_links(cfg: Qwen3_5MoeConfig) -> list[Link]:
    """Every tensor of `Qwen3_5MoeForConditionalGeneration` and where it lives in `Qwen3_5Moe`: Qwen3.5's, with each
    layer's dense MLP tensors renamed to its shared expert's (`mlp.shared_expert.*`, our `mlp.shared`) and followed
    by the layer's router, shared-expert gate and routed experts."""
    out: list[Link] = []
    for link in qwen3_5.weight_links(cfg):
        parts = link.hf_key.split(".")  # model.language_model.layers.{i}.mlp.{gate,up,down}_proj.weight
        if parts[2:3] != ["layers"] or parts[4] != "mlp":
            out.append(link)
            continue
        (path,) = link.ours  # ("layers", i, "mlp", leaf)
        shared = path[:3] + ("shared", path[3])
        out.append(dataclasses.replace(link, hf_key=link.hf_key.replace(".mlp.", ".mlp.shared_expert."), ours=(shared,)))
        if parts[5] == "down_proj":  # the last of the three: the rest of the block follows
            out += moe_links(".".join(parts[:5]) + ".", path[:3], cfg.text)
    return out


def init_std(path: tuple[Any, ...], shape: tuple[int, ...], cfg: Qwen3_5MoeConfig) -> float | None:
    """The tiny model's init of the stacked expert kernels (fan-in is their second axis, after the expert axis;
    the down projection further divided by sqrt(2 * layers) as every residual-branch output); the rest as Qwen3.5's."""
    leaf = str(path[-1])
    if leaf in ("gate_experts_edf", "up_experts_edf"):
        return shape[1] ** -0.5
    if leaf == "down_experts_efd":
        return shape[1] ** -0.5 / np.sqrt(2 * cfg.text.num_hidden_layers)
    return qwen3_5.init_std(path, shape, cfg)


# ----------------------------------------------------------------------------- engine: hybrid cache + routed experts


@struct.dataclass
class MoeHybridCache(qwen3_5.HybridCache):
    """Qwen3.5's `HybridCache` plus the experts each cached position was routed to: experts int32 [num_pages,
    page_size, num_hidden_layers, k], stored by page next to the full-attention layers' K/V (as
    `qwen3_vl_moe.MoeKVCache`, as SGLang keeps them by KV slot), so a reused prefix (its pages, with its linear
    layers' state from a snapshot) brings the routing its first request computed, and copy-on-write copies it. The
    linear layers' state rows carry none: a position's experts never change after it is computed."""

    experts: jax.Array

    def copy_page(self, src: jax.Array, dst: jax.Array) -> "MoeHybridCache":
        return super().copy_page(src, dst).replace(experts=self.experts.at[dst].set(self.experts[src]))

    def logical_axes(self) -> "MoeHybridCache":
        axes = super().logical_axes()
        return MoeHybridCache(axes.k, axes.v, axes.conv, axes.recurrent, (None, None, None, None))

    def routed_experts(self, pages: jax.Array, n: int) -> jax.Array:
        """int32 [n, num_hidden_layers, k]: the experts of positions [0, n) of the request with page table
        `pages` [P] (SGLang's `routed_experts` layout)."""
        rows = self.experts[pages]
        return rows.reshape(-1, *rows.shape[2:])[:n]


def init_cache(cfg: Qwen3_5MoeConfig, num_pages: int, page_size: int, max_slots: int,
               dtype: jnp.dtype) -> MoeHybridCache:
    base = qwen3_5.init_cache(cfg, num_pages, page_size, max_slots, dtype)
    shape = (num_pages, page_size, cfg.text.num_hidden_layers, cfg.text.num_experts_per_tok)
    return MoeHybridCache(base.k, base.v, base.conv, base.recurrent, jnp.full(shape, -1, jnp.int32))


def _store(cache: MoeHybridCache, routed: list[jax.Array], page: jax.Array, row: jax.Array) -> MoeHybridCache:
    """Every layer's top-k ids [N, k] of the positions at (page, row) [N] written where their K/V went (writes to
    page num_pages are dropped)."""
    ids = jnp.stack([r.reshape(-1, r.shape[-1]) for r in routed], axis=1)  # [N, L, k]
    return cache.replace(experts=cache.experts.at[page, row].set(ids, mode="drop"))


def prefill(model: Qwen3_5Moe, cache: MoeHybridCache, slot: jax.Array, table_p: jax.Array, start: jax.Array,
            tokens_1t: jax.Array, positions_31t: jax.Array, length: jax.Array,
            vision: Any) -> tuple[MoeHybridCache, jax.Array]:
    """`qwen3_5.prefill`, recording each prompt position's experts next to its K/V."""
    cache, logits, routed = qwen3_5.prefill_routed(model, cache, slot, table_p, start, tokens_1t, positions_31t,
                                                   length, vision)
    page, row = page_slots(table_p, start + jnp.arange(tokens_1t.shape[1]), cache.page_size, cache.num_pages)
    return _store(cache, routed, page, row), logits


def decode(model: Qwen3_5Moe, cache: MoeHybridCache, slots_b: jax.Array, tables_bp: jax.Array, tokens_b: jax.Array,
           lengths_b: jax.Array, rope_deltas_b: jax.Array) -> tuple[MoeHybridCache, jax.Array]:
    """`qwen3_5.decode`, recording the experts of each row's input token (position lengths_b; padding rows write
    nowhere)."""
    cache, logits, routed = qwen3_5.decode_routed(model, cache, slots_b, tables_bp, tokens_b, lengths_b,
                                                  rope_deltas_b)
    page, row = page_slots(tables_bp, lengths_b[:, None], cache.page_size, cache.num_pages)
    return _store(cache, routed, page[:, 0], row[:, 0]), logits


FAMILY_MODEL = FamilyModel(
    model_class=Qwen3_5Moe,
    weight_links=weight_links,
    init_cache=init_cache,
    prefill=prefill,
    decode=decode,
    init_std=init_std,
    ignored_checkpoint_keys=qwen3_5.IGNORED_CHECKPOINT_KEYS,  # transformers' Qwen3.5-MoE skips `mtp.*` too
)
