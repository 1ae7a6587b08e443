"""ff.TransformerEncoderLayer / DecoderLayer / Encoder / Decoder / Transformer.

Drop-in for the torch.nn classes of the same names: the same constructor arguments, forward
arguments (masks, key padding masks, is_causal hints) and state_dict keys, so
``load_state_dict`` works in both directions. What runs inside (B*L rows of width d_model):

  post-norm (norm_first=False), per sublayer f:  x = LayerNorm(x + dropout(f(x)))
      -> ff.add_layer_norm(dropout(f(x)), x): the add and the norm in one pass over memory.
  pre-norm (norm_first=True):  x = x + dropout(f(LayerNorm(x)))
      -> the sum x + dropout(f(..)) is never formed on its own: the *next* norm takes both
         terms (ff.add_layer_norm(.., return_residual=True) returns the norm and the new
         residual stream in one pass). In a stack, the last sublayer's output is carried
         into the next layer's first norm, and into the encoder's/decoder's final norm.
  self-/cross-attention: ff.MultiheadAttention (fused flash attention, need_weights=False).
  FFN: ff.ffn (bias + activation fused into the GEMM epilogue) for "relu"/"gelu" (and
      nn.ReLU / nn.GELU instances); a custom callable runs the plain torch FFN.

Extra constructor options (keyword-only, off by default):
  activation="swiglu": a gated FFN  linear2(silu(linear1(x)) * linear3(x))  (ff.swiglu_ffn);
      linear1 is the gate, linear3 (an extra nn.Linear) the up projection, linear2 the down
      projection (Llama's w1/w3/w2). dim_feedforward is the hidden width.
  norm="rmsnorm": ff.RMSNorm instead of LayerNorm (fused add + RMSNorm; no bias parameter).

Differences from torch.nn, documented: a query whose keys are all masked gives zeros (torch:
NaN); the nested-tensor inference path of nn.TransformerEncoder is not used (padded positions
are computed, not zeroed); attention dropout uses fastformer's counter-based RNG, so with
dropout > 0 the masks differ from torch's (the statistics match).
"""
from __future__ import annotations

import copy
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _checks
from ..ops.ffn import ffn, swiglu_ffn
from ..ops.norm import add_layer_norm, rms_norm
from .attention import MultiheadAttention
from .norm import LayerNorm, RMSNorm

_NORMS = ("layernorm", "rmsnorm")


# ---- shared pieces ----------------------------------------------------------------------------
def _kernel_activation(activation) -> Optional[str]:
    """The fused FFN's name for a torch activation, or None (run it as a plain callable)."""
    if activation is F.relu or isinstance(activation, nn.ReLU):
        return "relu"
    if activation is F.gelu or (isinstance(activation, nn.GELU) and activation.approximate == "none"):
        return "gelu"
    if isinstance(activation, nn.GELU) and activation.approximate == "tanh":
        return "gelu_tanh"
    return None


def _resolve_activation(fn: str, activation) -> Callable:
    if isinstance(activation, str):
        table = {"relu": F.relu, "gelu": F.gelu, "swiglu": F.silu}
        if activation not in table:
            raise ValueError(f"{fn}: `activation` must be 'relu', 'gelu', 'swiglu' or a callable; "
                             f"got {activation!r}")
        return table[activation]
    if not callable(activation):
        raise TypeError(f"{fn}: `activation` must be a string or a callable, got "
                        f"{type(activation).__name__}")
    return activation


def _make_norm(fn: str, norm: str, d_model: int, eps: float, bias: bool, factory: dict) -> nn.Module:
    _checks.choice(fn, "norm", norm, _NORMS)
    if norm == "rmsnorm":
        return RMSNorm(d_model, eps=eps, **factory)
    return LayerNorm(d_model, eps=eps, bias=bias, **factory)


def _add_norm(norm: nn.Module, x: Tensor, residual: Optional[Tensor], return_residual: bool = False):
    """``norm(x + residual)`` (and ``x + residual`` if asked), fused for LayerNorm / RMSNorm over
    the last dim (torch's or ours); any other norm module runs unfused."""
    if len(getattr(norm, "normalized_shape", ())) == 1:
        if isinstance(norm, nn.LayerNorm):
            return add_layer_norm(x, residual, norm.weight, norm.bias, norm.eps,
                                  return_residual=return_residual)
        if isinstance(norm, nn.RMSNorm):
            eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
            return rms_norm(x, norm.weight, eps, residual=residual, return_residual=return_residual)
    z = x if residual is None else x + residual
    return (norm(z), z) if return_residual else norm(z)


def _dropout(x: Tensor, module: nn.Dropout, training: bool) -> Tensor:
    return F.dropout(x, module.p, training=True) if training and module.p > 0 else x


def _get_clones(module: nn.Module, n: int) -> nn.ModuleList:
    return nn.ModuleList([copy.deepcopy(module) for _ in range(n)])


def _seq_len(x: Tensor, batch_first: bool) -> int:
    return x.shape[1] if (batch_first and x.dim() == 3) else x.shape[0]


def _detect_is_causal_mask(mask: Optional[Tensor], is_causal: Optional[bool], size: int) -> bool:
    """torch.nn's rule: an explicit hint wins; else a mask equal to the square causal mask of
    the sequence (float -inf above the diagonal, or bool True there) counts as causal."""
    if is_causal is None and mask is not None:
        causal = torch.triu(torch.full((size, size), float("-inf"), dtype=mask.dtype,
                                       device=mask.device), diagonal=1)
        return mask.shape == causal.shape and bool((mask == causal).all())
    return bool(is_causal)


def _check_width(layer, name: str, t) -> None:
    d_model = layer.self_attn.embed_dim
    if not isinstance(t, Tensor):
        raise TypeError(f"{type(layer).__name__}: `{name}` must be a Tensor, got "
                        f"{type(t).__name__}")
    if t.dim() not in (2, 3) or t.shape[-1] != d_model:
        raise ValueError(f"{type(layer).__name__}: `{name}` must have shape (L, {d_model}) or "
                         f"batched (L, N, {d_model}) / (N, L, {d_model}) with d_model = "
                         f"{d_model}, got {tuple(t.shape)}")


class _FeedForwardLayer(nn.Module):
    """The FFN sublayer shared by the encoder and decoder layers (submodules named as torch's)."""

    def _init_ffn(self, fn, d_model, dim_feedforward, dropout, activation, bias, factory):
        for name, v in (("d_model", d_model), ("dim_feedforward", dim_feedforward)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{fn}: `{name}` must be a positive int, got {v!r}")
        _checks.number(fn, "dropout", dropout, lo=0.0, hi=1.0)
        self.linear1 = nn.Linear(d_model, dim_feedforward, bias=bias, **factory)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias=bias, **factory)
        self.gated = activation == "swiglu"
        if self.gated:
            self.linear3 = nn.Linear(d_model, dim_feedforward, bias=bias, **factory)
        self.activation = _resolve_activation(fn, activation)
        kind = _kernel_activation(self.activation)
        self.activation_relu_or_gelu = 1 if kind == "relu" else 2 if kind in ("gelu", "gelu_tanh") else 0

    def _ff_block(self, x: Tensor, out_dropout: nn.Dropout) -> Tensor:
        p = self.dropout.p if self.training else 0.0
        l1, l2 = self.linear1, self.linear2
        if self.gated:
            if p > 0:  # ff.swiglu_ffn has no hidden dropout: this case runs unfused
                y = l2(F.dropout(F.silu(l1(x)) * self.linear3(x), p, training=True))
            else:
                y = swiglu_ffn(x, l1.weight, self.linear3.weight, l2.weight, l1.bias,
                               self.linear3.bias, l2.bias, activation="silu")
        else:
            kind = _kernel_activation(self.activation)
            if kind is None:
                y = l2(self.dropout(self.activation(l1(x))))
            else:
                y = ffn(x, l1.weight, l1.bias, l2.weight, l2.bias, activation=kind, dropout_p=p)
        return _dropout(y, out_dropout, self.training)


# ---- layers -----------------------------------------------------------------------------------
class TransformerEncoderLayer(_FeedForwardLayer):
    """Drop-in ``nn.TransformerEncoderLayer`` (self-attention + FFN); see the module docstring.

    Args: as torch's (d_model, nhead, dim_feedforward=2048, dropout=0.1, activation=F.relu,
    layer_norm_eps=1e-5, batch_first=False, norm_first=False, bias=True, device, dtype), plus
    keyword-only ``norm="layernorm"|"rmsnorm"``; ``activation`` also takes ``"swiglu"``.
    """

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation: Union[str, Callable[[Tensor], Tensor]] = F.relu,
                 layer_norm_eps: float = 1e-5, batch_first: bool = False, norm_first: bool = False,
                 bias: bool = True, device=None, dtype=None, *, norm: str = "layernorm"):
        super().__init__()
        fn, factory = "TransformerEncoderLayer", {"device": device, "dtype": dtype}
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias,
                                            batch_first=batch_first, **factory)
        self._init_ffn(fn, d_model, dim_feedforward, dropout, activation, bias, factory)
        self.norm_first = norm_first
        self.norm1 = _make_norm(fn, norm, d_model, layer_norm_eps, bias, factory)
        self.norm2 = _make_norm(fn, norm, d_model, layer_norm_eps, bias, factory)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)

    def forward(self, src: Tensor, src_mask: Optional[Tensor] = None,
                src_key_padding_mask: Optional[Tensor] = None, is_causal: bool = False) -> Tensor:
        _check_width(self, "src", src)
        x, pending = self._run(src, None, src_mask, src_key_padding_mask, is_causal)
        return x if pending is None else x + pending

    def _sa_block(self, x, attn_mask, key_padding_mask, is_causal):
        y = self.self_attn(x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                           need_weights=False, is_causal=is_causal)[0]
        return _dropout(y, self.dropout1, self.training)

    def _run(self, x, pending, src_mask, src_key_padding_mask, is_causal):
        """The layer on input ``x + pending`` (pending: an unadded pre-norm sublayer output
        or None); returns (x, pending) the same way."""
        if self.norm_first:
            h, x = _add_norm(self.norm1, x, pending, return_residual=True)
            h, x = _add_norm(self.norm2, x, self._sa_block(h, src_mask, src_key_padding_mask,
                                                           is_causal), return_residual=True)
            return x, self._ff_block(h, self.dropout2)
        if pending is not None:
            x = x + pending
        x = _add_norm(self.norm1, x, self._sa_block(x, src_mask, src_key_padding_mask, is_causal))
        return _add_norm(self.norm2, x, self._ff_block(x, self.dropout2)), None


class TransformerDecoderLayer(_FeedForwardLayer):
    """Drop-in ``nn.TransformerDecoderLayer``: masked self-attention, cross-attention over the
    memory (Lq != Lk allowed), FFN; arguments as :class:`TransformerEncoderLayer`."""

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation: Union[str, Callable[[Tensor], Tensor]] = F.relu,
                 layer_norm_eps: float = 1e-5, batch_first: bool = False, norm_first: bool = False,
                 bias: bool = True, device=None, dtype=None, *, norm: str = "layernorm"):
        super().__init__()
        fn, factory = "TransformerDecoderLayer", {"device": device, "dtype": dtype}
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias,
                                            batch_first=batch_first, **factory)
        self.multihead_attn = MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias,
                                                 batch_first=batch_first, **factory)
        self._init_ffn(fn, d_model, dim_feedforward, dropout, activation, bias, factory)
        self.norm_first = norm_first
        self.norm1 = _make_norm(fn, norm, d_model, layer_norm_eps, bias, factory)
        self.norm2 = _make_norm(fn, norm, d_model, layer_norm_eps, bias, factory)
        self.norm3 = _make_norm(fn, norm, d_model, layer_norm_eps, bias, factory)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.dropout3 = nn.Dropout(dropout)

    def forward(self, tgt: Tensor, memory: Tensor, tgt_mask: Optional[Tensor] = None,
                memory_mask: Optional[Tensor] = None,
                tgt_key_padding_mask: Optional[Tensor] = None,
                memory_key_padding_mask: Optional[Tensor] = None, tgt_is_causal: bool = False,
                memory_is_causal: bool = False) -> Tensor:
        _check_width(self, "tgt", tgt)
        _check_width(self, "memory", memory)
        x, pending = self._run(tgt, None, memory, tgt_mask, memory_mask, tgt_key_padding_mask,
                               memory_key_padding_mask, tgt_is_causal, memory_is_causal)
        return x if pending is None else x + pending

    def _sa_block(self, x, attn_mask, key_padding_mask, is_causal):
        y = self.self_attn(x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                           need_weights=False, is_causal=is_causal)[0]
        return _dropout(y, self.dropout1, self.training)

    def _mha_block(self, x, memory, attn_mask, key_padding_mask, is_causal):
        y = self.multihead_attn(x, memory, memory, attn_mask=attn_mask,
                                key_padding_mask=key_padding_mask, need_weights=False,
                                is_causal=is_causal)[0]
        return _dropout(y, self.dropout2, self.training)

    def _run(self, x, pending, memory, tgt_mask, memory_mask, tgt_key_padding_mask,
             memory_key_padding_mask, tgt_is_causal, memory_is_causal):
        """As TransformerEncoderLayer._run."""
        if self.norm_first:
            h, x = _add_norm(self.norm1, x, pending, return_residual=True)
            sa = self._sa_block(h, tgt_mask, tgt_key_padding_mask, tgt_is_causal)
            h, x = _add_norm(self.norm2, x, sa, return_residual=True)
            ca = self._mha_block(h, memory, memory_mask, memory_key_padding_mask, memory_is_causal)
            h, x = _add_norm(self.norm3, x, ca, return_residual=True)
            return x, self._ff_block(h, self.dropout3)
        if pending is not None:
            x = x + pending
        x = _add_norm(self.norm1, x, self._sa_block(x, tgt_mask, tgt_key_padding_mask, tgt_is_causal))
        x = _add_norm(self.norm2, x, self._mha_block(x, memory, memory_mask,
                                                     memory_key_padding_mask, memory_is_causal))
        return _add_norm(self.norm3, x, self._ff_block(x, self.dropout3)), None


# ---- stacks -----------------------------------------------------------------------------------
def _finish(norm: Optional[nn.Module], x: Tensor, pending: Optional[Tensor]) -> Tensor:
    if norm is not None:
        return _add_norm(norm, x, pending)
    return x if pending is None else x + pending


class TransformerEncoder(nn.Module):
    """Drop-in ``nn.TransformerEncoder``: ``num_layers`` deep copies of ``encoder_layer``, then
    ``norm`` if given. Pre-norm fastformer layers hand their last residual add to the next
    layer's first fused add+norm (and to ``norm``). ``enable_nested_tensor`` and ``mask_check``
    are accepted for compatibility; the nested-tensor path is never used (padding is handled
    by the attention kernel's key padding mask)."""

    def __init__(self, encoder_layer: nn.Module, num_layers: int, norm: Optional[nn.Module] = None,
                 enable_nested_tensor: bool = True, mask_check: bool = True):
        super().__init__()
        self.layers = _get_clones(encoder_layer, num_layers)
        self.num_layers = num_layers
        self.norm = norm
        self.enable_nested_tensor = enable_nested_tensor
        self.use_nested_tensor = False
        self.mask_check = mask_check

    def forward(self, src: Tensor, mask: Optional[Tensor] = None,
                src_key_padding_mask: Optional[Tensor] = None,
                is_causal: Optional[bool] = None) -> Tensor:
        first = self.layers[0] if len(self.layers) else None
        batch_first = bool(getattr(getattr(first, "self_attn", None), "batch_first", False))
        is_causal = _detect_is_causal_mask(mask, is_causal, _seq_len(src, batch_first))
        x, pending = src, None
        for layer in self.layers:
            if isinstance(layer, TransformerEncoderLayer):
                x, pending = layer._run(x, pending, mask, src_key_padding_mask, is_causal)
            else:
                x = layer(x if pending is None else x + pending, src_mask=mask,
                          is_causal=is_causal, src_key_padding_mask=src_key_padding_mask)
                pending = None
        return _finish(self.norm, x, pending)


class TransformerDecoder(nn.Module):
    """Drop-in ``nn.TransformerDecoder``: ``num_layers`` deep copies of ``decoder_layer``, then
    ``norm`` if given (pre-norm residual adds fused as in :class:`TransformerEncoder`)."""

    def __init__(self, decoder_layer: nn.Module, num_layers: int, norm: Optional[nn.Module] = None):
        super().__init__()
        self.layers = _get_clones(decoder_layer, num_layers)
        self.num_layers = num_layers
        self.norm = norm

    def forward(self, tgt: Tensor, memory: Tensor, tgt_mask: Optional[Tensor] = None,
                memory_mask: Optional[Tensor] = None,
                tgt_key_padding_mask: Optional[Tensor] = None,
                memory_key_padding_mask: Optional[Tensor] = None,
                tgt_is_causal: Optional[bool] = None, memory_is_causal: bool = False) -> Tensor:
        first = self.layers[0] if len(self.layers) else None
        batch_first = bool(getattr(getattr(first, "self_attn", None), "batch_first", False))
        tgt_is_causal = _detect_is_causal_mask(tgt_mask, tgt_is_causal, _seq_len(tgt, batch_first))
        x, pending = tgt, None
        for layer in self.layers:
            if isinstance(layer, TransformerDecoderLayer):
                x, pending = layer._run(x, pending, memory, tgt_mask, memory_mask,
                                        tgt_key_padding_mask, memory_key_padding_mask,
                                        tgt_is_causal, memory_is_causal)
            else:
                x = layer(x if pending is None else x + pending, memory, tgt_mask=tgt_mask,
                          memory_mask=memory_mask, tgt_key_padding_mask=tgt_key_padding_mask,
                          memory_key_padding_mask=memory_key_padding_mask,
                          tgt_is_causal=tgt_is_causal, memory_is_causal=memory_is_causal)
                pending = None
        return _finish(self.norm, x, pending)


class Transformer(nn.Module):
    """Drop-in ``nn.Transformer`` (encoder-decoder) built from fastformer layers.

    Args: torch's (d_model=512, nhead=8, num_encoder_layers=6, num_decoder_layers=6,
    dim_feedforward=2048, dropout=0.1, activation=F.relu, custom_encoder=None,
    custom_decoder=None, layer_norm_eps=1e-5, batch_first=False, norm_first=False, bias=True,
    device, dtype), plus keyword-only ``norm`` as the layers'. Parameters with more than one
    dim are initialised xavier-uniform, as torch does.
    """

    def __init__(self, d_model: int = 512, nhead: int = 8, num_encoder_layers: int = 6,
                 num_decoder_layers: int = 6, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation: Union[str, Callable[[Tensor], Tensor]] = F.relu,
                 custom_encoder: Optional[nn.Module] = None,
                 custom_decoder: Optional[nn.Module] = None, layer_norm_eps: float = 1e-5,
                 batch_first: bool = False, norm_first: bool = False, bias: bool = True,
                 device=None, dtype=None, *, norm: str = "layernorm"):
        super().__init__()
        fn, factory = "Transformer", {"device": device, "dtype": dtype}
        layer_args = (d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps,
                      batch_first, norm_first, bias)
        if custom_encoder is not None:
            self.encoder = custom_encoder
        else:
            self.encoder = TransformerEncoder(
                TransformerEncoderLayer(*layer_args, norm=norm, **factory), num_encoder_layers,
                _make_norm(fn, norm, d_model, layer_norm_eps, bias, factory))
        if custom_decoder is not None:
            self.decoder = custom_decoder
        else:
            self.decoder = TransformerDecoder(
                TransformerDecoderLayer(*layer_args, norm=norm, **factory), num_decoder_layers,
                _make_norm(fn, norm, d_model, layer_norm_eps, bias, factory))
        self._reset_parameters()
        self.d_model, self.nhead, self.batch_first = d_model, nhead, batch_first

    def forward(self, src: Tensor, tgt: Tensor, src_mask: Optional[Tensor] = None,
                tgt_mask: Optional[Tensor] = None, memory_mask: Optional[Tensor] = None,
                src_key_padding_mask: Optional[Tensor] = None,
                tgt_key_padding_mask: Optional[Tensor] = None,
                memory_key_padding_mask: Optional[Tensor] = None,
                src_is_causal: Optional[bool] = None, tgt_is_causal: Optional[bool] = None,
                memory_is_causal: bool = False) -> Tensor:
        fn = "Transformer"
        if src.dim() == 3:
            bdim = 0 if self.batch_first else 1
            if src.shape[bdim] != tgt.shape[bdim]:
                raise ValueError(f"{fn}: `src` and `tgt` must have the same batch size, got "
                                 f"{src.shape[bdim]} and {tgt.shape[bdim]}")
        if src.shape[-1] != self.d_model or tgt.shape[-1] != self.d_model:
            raise ValueError(f"{fn}: the last dim of `src` and `tgt` must be d_model = "
                             f"{self.d_model}, got {src.shape[-1]} and {tgt.shape[-1]}")
        memory = self.encoder(src, mask=src_mask, src_key_padding_mask=src_key_padding_mask,
                              is_causal=src_is_causal)
        return self.decoder(tgt, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                            tgt_key_padding_mask=tgt_key_padding_mask,
                            memory_key_padding_mask=memory_key_padding_mask,
                            tgt_is_causal=tgt_is_causal, memory_is_causal=memory_is_causal)

    @staticmethod
    def generate_square_subsequent_mask(sz: int, device=None, dtype=None) -> Tensor:
        """Float (sz, sz) causal mask: -inf above the diagonal, 0 elsewhere (as torch's)."""
        return torch.triu(torch.full((sz, sz), float("-inf"), dtype=dtype, device=device),
                          diagonal=1)

    def _reset_parameters(self) -> None:
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)


__all__ = ["TransformerEncoderLayer", "TransformerDecoderLayer", "TransformerEncoder",
           "TransformerDecoder", "Transformer"]
