"""ff.convert for DeBERTa-v2 / v3's disentangled attention (``DisentangledSelfAttention`` of
transformers' deberta_v2; mDeBERTa and every DeBERTa-v3 checkpoint are this architecture, and
SEW-D's attention is a copy of it).

The model's attention is its own code, outside transformers' attention interface: the
(B * H, L, L) scores ``q k^T / s`` plus two relative-position terms, masked with the dtype's
minimum, an eager softmax into another (B * H, L, L) tensor, dropout, and a bmm with V
(s = sqrt(D * (1 + number of relative terms))). The relative terms, with a bucketed relative
position r(i, j) = bucket(i - j) and a span S (``position_buckets``, or the largest position):

  content -> position  c2p[i, j] = q_i . pk[clamp(r(i, j) + S)] / s    pk = rel_emb W_pk (2S rows)
  position -> content  p2c[i, j] = k_j . pq[clamp(-r(j, i) + S)] / s   pq = rel_emb W_pq

The converted forward forms the (B, H, L, 2S) products against the 2S relative embeddings as the
original does (with q and k scaled first), then one pass of ``relative_bias``
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
another dtype than the weights, relative positions given per batch row, masks of another shape.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..ops.attention import attention
from ..ops.relative_bias import relative_bias


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(..., L, H * D) -> (..., H, L, D), a view."""
    return x.unflatten(-1, (heads, -1)).transpose(-3, -2)


class DebertaV2AttentionMixin:
    _ff_what = "ff.attention with the relative terms as a bias (no score or probability tensors)"

    def forward(self, hidden_states, attention_mask, output_attentions=False, query_states=None,
                relative_pos=None, rel_embeddings=None):
        if output_attentions or query_states is not None or not self._ff_takes(hidden_states, attention_mask,
                                                                                relative_pos, rel_embeddings):
            return super().forward(hidden_states, attention_mask, output_attentions, query_states,
                                   relative_pos, rel_embeddings)
        B, L = hidden_states.shape[:2]
        heads = self.num_attention_heads
        q, k, v = (_heads(proj(hidden_states), heads) for proj in (self.query_proj, self.key_proj, self.value_proj))
        factor = 1 + ("c2p" in self.pos_att_type) + ("p2c" in self.pos_att_type)
        scale = float(q.shape[-1] * factor) ** -0.5
        visible = attention_mask.bool().expand(B, 1, L, L)             # True = attend
        if self.relative_attention and ("c2p" in self.pos_att_type or "p2c" in self.pos_att_type):
            bias = self._ff_relative_terms(q * scale, k * scale, relative_pos, self.pos_dropout(rel_embeddings),
                                           visible.reshape(B, L, L))
        else:  # no relative terms (the original adds 0)
            bias = visible
        p = self.dropout.p if self.training else 0.0
        context = attention(q, k, v, attn_mask=bias, dropout_p=p, scale=scale)
        # rows without a visible key: the original's softmax over equal scores, the mean of V
        context = torch.where(visible.any(-1, keepdim=True), context, v.mean(-2, keepdim=True))
        return context.transpose(1, 2).flatten(2), None

    def _ff_takes(self, hidden_states, attention_mask, relative_pos, rel_embeddings) -> bool:
        L = hidden_states.shape[1]
        return (attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1] == 1
                and all(n in (1, L) for n in attention_mask.shape[2:])
                and hidden_states.dtype == self.query_proj.weight.dtype
                and not (self.relative_attention and (rel_embeddings is None or not _one_rel_pos(relative_pos))))

    def _ff_relative_terms(self, q, k, relative_pos, rel_embeddings, visible):
        """c2p + p2c as (B, H, L, L), -inf where not visible, from q and k already scaled by 1 / s."""
        span = self.pos_ebd_size
        if relative_pos is None:
            relative_pos = self._ff_build_relative_position(q, k, bucket_size=self.position_buckets,
                                                            max_position=self.max_relative_positions)
        rel = relative_pos.reshape(relative_pos.shape[-2:]).to(device=q.device, dtype=torch.long)   # (L, L)
        rel_embeddings = rel_embeddings[:2 * span]
        heads = self.num_attention_heads
        c2p = p2c = c2p_index = p2c_index = None
        if "c2p" in self.pos_att_type:
            proj = self.key_proj if self.share_att_key else self.pos_key_proj
            c2p = q @ _heads(proj(rel_embeddings), heads).transpose(-1, -2)        # (B, H, L, 2S)
            c2p_index = torch.clamp(rel + span, 0, 2 * span - 1)
        if "p2c" in self.pos_att_type:
            proj = self.query_proj if self.share_att_key else self.pos_query_proj
            p2c = k @ _heads(proj(rel_embeddings), heads).transpose(-1, -2)        # (B, H, L, 2S)
            # p2c[i, j] = (k pq^T)[j, clamp(-r(j, i) + S)]: the table indexed (query, key)
            p2c_index = torch.clamp(-rel + span, 0, 2 * span - 1).transpose(0, 1).contiguous()
        return relative_bias(c2p, p2c, c2p_index, p2c_index, visible)


def _one_rel_pos(relative_pos) -> bool:
    """The relative positions the model builds: one (L, L) table for every row (or none)."""
    return relative_pos is None or (relative_pos.dim() in (2, 3, 4) and relative_pos.shape[:-2].numel() == 1)


def convert_deberta_v2_attention(m: nn.Module, swap) -> Optional[str]:
    """Swap a deberta_v2 DisentangledSelfAttention for DebertaV2AttentionMixin, or say why not."""
    import sys
    module = sys.modules.get(type(m).__module__)
    build = getattr(module, "build_relative_position", None)
    if not isinstance(getattr(m, "query_proj", None), nn.Linear) or build is None:
        return ("not DeBERTa-v2's form (separate query / key / value projections; DeBERTa v1's fused "
                "in_proj with q_bias / v_bias runs its own code)")
    m._ff_build_relative_position = build
    swap(m, DebertaV2AttentionMixin)
    return None


__all__ = ["convert_deberta_v2_attention"]
