"""ff.convert for DeBERTa's disentangled attention (``DisentangledSelfAttention``): deberta_v2's
(DeBERTa-v2 / v3, mDeBERTa; SEW-D's attention is a copy of it) and deberta's (v1: one fused
``in_proj`` with ``q_bias`` / ``v_bias``, unbucketed positions, span min(L, max_relative_positions),
the relative embeddings' projections ``pos_proj`` / ``pos_q_proj``; the same computation below).

The model's attention is its own code, outside transformers' attention interface: the
(B * H, L, L) scores ``q k^T / s`` plus two relative-position terms, masked with the dtype's
minimum, an eager softmax into another (B * H, L, L) tensor, dropout, and a bmm with V
(s = sqrt(D * (1 + number of relative terms))). The relative terms, with a bucketed relative
position r(i, j) = bucket(i - j) and a span S (``position_buckets``, or the largest position):

  content -> position  c2p[i, j] = q_i . pk[clamp(r(i, j) + S)] / s    pk = rel_emb W_pk (2S rows)
  position -> content  p2c[i, j] = k_j . pq[clamp(-r(j, i) + S)] / s   pq = rel_emb W_pq

The converted forward forms the (B, H, L, 2S) products against the 2S relative embeddings as the
original does (with the projected embeddings scaled first), then one pass of ``relative_bias``
(ops/relative_bias.py) gathers both terms into the (B, H, L, L) bias with the mask folded in
(-inf where the original writes the dtype's minimum), which ``ff.attention`` adds to its scores;
the kernels' backward writes the bias gradient, which relative_bias's backward scatters back into
the two products. Against the original this leaves out the score and probability tensors (and
the add, masked_fill, softmax and dropout passes over them) and torch.gather's copies (~28 ms per
(4, 12, 512, 512) bf16 gather on 2 Zen 5 cores); the bias itself is still L^2 per head, written
once and read once forward and once backward.

Query rows that see no key (the padded rows: the model's mask is the outer product of the
padding mask with itself) are uniform over every key in the original (all scores equal to the
minimum), so their output is the mean of V: the converted forward returns exactly that for
them, and the kernels' zeros for those rows carry no gradient.

Calls the kernels do not cover run the original forward: ``output_attentions`` (it returns the
probabilities), ``query_states`` (the enhanced mask decoder's second pass), activations in
another dtype than the weights, relative positions given per batch row, masks of another shape;
v1's talking heads (``head_logits_proj`` mixes the heads' scores) are not converted.
"""
from __future__ import annotations

import sys
from typing import Optional

import torch
from torch import nn

from ..ops.attention import attention
from ..ops.relative_bias import relative_bias


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(..., L, H * D) -> (..., H, L, D), a view."""
    return x.unflatten(-1, (heads, -1)).transpose(-3, -2)


class _DisentangledAttention:
    """The converted forward of both DeBERTa versions; each subclass reads its projections."""

    _ff_what = "ff.attention with the relative terms as a bias (no score or probability tensors)"

    def forward(self, hidden_states, attention_mask, output_attentions=False, query_states=None,
                relative_pos=None, rel_embeddings=None):
        terms = self._ff_has_terms(relative_pos, rel_embeddings)
        if output_attentions or query_states is not None or not self._ff_takes(hidden_states, attention_mask,
                                                                                relative_pos, terms):
            return super().forward(hidden_states, attention_mask, output_attentions, query_states,
                                   relative_pos, rel_embeddings)
        B, L = hidden_states.shape[:2]
        q, k, v = self._ff_qkv(hidden_states)                            # (B, H, L, D)
        scale = float(q.shape[-1] * self._ff_factor()) ** -0.5
        visible = attention_mask.bool().expand(B, 1, L, L)             # True = attend
        if terms:
            rel, span, pos_key, pos_query = self._ff_positions(q, k, relative_pos, self.pos_dropout(rel_embeddings))
            # 1 / s on the 2S projected embeddings, not on the B * L rows of q and k (and their
            # scaled copies kept for the products' backward)
            bias = _relative_terms(q, k, rel, span, None if pos_key is None else pos_key * scale,
                                   None if pos_query is None else pos_query * scale, visible.reshape(B, L, L),
                                   self.num_attention_heads)
        else:  # no relative terms (the original adds 0)
            bias = visible
        p = self.dropout.p if self.training else 0.0
        context = attention(q, k, v, attn_mask=bias, dropout_p=p, scale=scale)
        # rows without a visible key: the original's softmax over equal scores, the mean of V
        context = torch.where(visible.any(-1, keepdim=True), context, v.mean(-2, keepdim=True))
        return context.transpose(1, 2).flatten(2), None

    def _ff_takes(self, hidden_states, attention_mask, relative_pos, terms) -> bool:
        L = hidden_states.shape[1]
        return (attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1] == 1
                and all(n in (1, L) for n in attention_mask.shape[2:])
                and hidden_states.dtype == self._ff_weight().dtype
                and not (terms and not _one_rel_pos(relative_pos)))


class DebertaV2AttentionMixin(_DisentangledAttention):
    """deberta_v2's DisentangledSelfAttention: query / key / value projections, bucketed positions
    (built here when the call passes none, as the original does)."""

    def _ff_weight(self):
        return self.query_proj.weight

    def _ff_qkv(self, hidden_states):
        return (_heads(proj(hidden_states), self.num_attention_heads)
                for proj in (self.query_proj, self.key_proj, self.value_proj))

    def _ff_factor(self) -> int:
        return 1 + ("c2p" in self.pos_att_type) + ("p2c" in self.pos_att_type)

    def _ff_has_terms(self, relative_pos, rel_embeddings) -> bool:
        return (self.relative_attention and rel_embeddings is not None
                and ("c2p" in self.pos_att_type or "p2c" in self.pos_att_type))

    def _ff_positions(self, q, k, relative_pos, rel_embeddings):
        span = self.pos_ebd_size
        if relative_pos is None:
            relative_pos = self._ff_build_relative_position(q, k, bucket_size=self.position_buckets,
                                                            max_position=self.max_relative_positions)
        rel_embeddings = rel_embeddings[:2 * span]
        pos_key = pos_query = None
        if "c2p" in self.pos_att_type:
            pos_key = (self.key_proj if self.share_att_key else self.pos_key_proj)(rel_embeddings)
        if "p2c" in self.pos_att_type:
            pos_query = (self.query_proj if self.share_att_key else self.pos_query_proj)(rel_embeddings)
        return relative_pos, span, pos_key, pos_query


class DebertaV1AttentionMixin(_DisentangledAttention):
    """deberta's DisentangledSelfAttention: one fused in_proj (per head [q; k; v]) with q_bias /
    v_bias added after it, unbucketed positions, the span min(L, max_relative_positions), the
    relative terms only when the call passes the positions."""

    def _ff_weight(self):
        return self.in_proj.weight

    def _ff_qkv(self, hidden_states):
        heads = self.num_attention_heads
        q, k, v = _heads(self.in_proj(hidden_states), heads).chunk(3, dim=-1)
        return q + self.q_bias.view(heads, 1, -1), k, v + self.v_bias.view(heads, 1, -1)

    def _ff_factor(self) -> int:
        return 1 + len(self.pos_att_type)

    def _ff_has_terms(self, relative_pos, rel_embeddings) -> bool:
        return (self.relative_attention and rel_embeddings is not None and relative_pos is not None
                and ("c2p" in self.pos_att_type or "p2c" in self.pos_att_type))

    def _ff_positions(self, q, k, relative_pos, rel_embeddings):
        span = min(q.shape[-2], self.max_relative_positions)
        rel_embeddings = rel_embeddings[self.max_relative_positions - span:self.max_relative_positions + span]
        pos_key = self.pos_proj(rel_embeddings) if "c2p" in self.pos_att_type else None
        pos_query = self.pos_q_proj(rel_embeddings) if "p2c" in self.pos_att_type else None
        return relative_pos, span, pos_key, pos_query


def _relative_terms(q, k, relative_pos, span, pos_key, pos_query, visible, heads):
    """c2p + p2c as (B, H, L, L), -inf where not visible, from q, k and the 2S relative embeddings
    projected to keys (pos_key) and queries (pos_query), either None, scaled by 1 / s."""
    rel = relative_pos.reshape(relative_pos.shape[-2:]).to(device=q.device, dtype=torch.long)   # (L, L)
    c2p = p2c = c2p_index = p2c_index = None
    if pos_key is not None:
        c2p = q @ _heads(pos_key, heads).transpose(-1, -2)                   # (B, H, L, 2S)
        c2p_index = torch.clamp(rel + span, 0, 2 * span - 1)
    if pos_query is not None:
        p2c = k @ _heads(pos_query, heads).transpose(-1, -2)                 # (B, H, L, 2S)
        # p2c[i, j] = (k pq^T)[j, clamp(-r(j, i) + S)]: the table indexed (query, key)
        p2c_index = torch.clamp(-rel + span, 0, 2 * span - 1).transpose(0, 1).contiguous()
    return relative_bias(c2p, p2c, c2p_index, p2c_index, visible)


def _one_rel_pos(relative_pos) -> bool:
    """The relative positions the model builds: one (L, L) table for every row (or none)."""
    return relative_pos is None or (relative_pos.dim() in (2, 3, 4) and relative_pos.shape[:-2].numel() == 1)


def convert_disentangled_attention(m: nn.Module, swap) -> Optional[str]:
    """Swap a DisentangledSelfAttention (DeBERTa-v2 / v3, SEW-D; DeBERTa v1) for its mixin, or
    say why not."""
    module = sys.modules.get(type(m).__module__)
    if isinstance(getattr(m, "query_proj", None), nn.Linear):
        build = getattr(module, "build_relative_position", None)
        if build is None:
            return "its module has no build_relative_position (another DeBERTa-v2 version)"
        m._ff_build_relative_position = build
        swap(m, DebertaV2AttentionMixin)
        return None
    if isinstance(getattr(m, "in_proj", None), nn.Linear) and isinstance(getattr(m, "q_bias", None), torch.Tensor):
        if getattr(m, "head_logits_proj", None) is not None:
            return "DeBERTa v1 with talking heads (head_logits_proj mixes the heads' scores): its own code"
        swap(m, DebertaV1AttentionMixin)
        return None
    return "neither DeBERTa-v2's form (query / key / value projections) nor v1's (in_proj, q_bias / v_bias)"


__all__ = ["convert_disentangled_attention"]
