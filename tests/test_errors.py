"""Error catalogue: every public function and module, each class of bad input,
a ValueError/TypeError/NotImplementedError whose message names the argument; never a crash.

Each row: (callable, exception type, argument name that must appear in the message).
"""
import pytest
import torch

import fastformer as ff

X = torch.randn(4, 16)
W = torch.randn(16)
Q, K, V = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
META = torch.randn(4, 16, device="meta")
W1, W2, WU = torch.randn(32, 16), torch.randn(16, 32), torch.randn(32, 16)
B1, B2 = torch.randn(32), torch.randn(16)
ROT_X = torch.randn(2, 4, 8, 16)
LCE_X, LCE_W, LCE_T = torch.randn(2, 3, 16), torch.randn(10, 16), torch.randint(0, 10, (2, 3))

CATALOGUE = {
    # rank / shape
    "norm: x without a normalized dim": (lambda: ff.layer_norm(torch.randn(4, 0), None, None), ValueError, "x"),
    "norm: residual shape": (lambda: ff.add_layer_norm(X, X[:2], None, None), ValueError, "residual"),
    "norm: weight shape": (lambda: ff.layer_norm(X, W[:3], None), ValueError, "weight"),
    "norm: bias rank": (lambda: ff.layer_norm(X, None, W[None]), ValueError, "bias"),
    "attention: q rank": (lambda: ff.attention(Q[0], K, V), ValueError, "q"),
    "attention: k batch": (lambda: ff.attention(Q, K[:1], V[:1]), ValueError, "k"),
    "attention: head dim": (lambda: ff.attention(Q, K[..., :8], V), ValueError, "k"),
    "attention: v length": (lambda: ff.attention(Q, K, V[:, :, :4]), ValueError, "v"),
    "attention: heads not divisible": (lambda: ff.attention(torch.randn(2, 3, 8, 16), K, V), ValueError, "q"),
    "attention: mask shape": (lambda: ff.attention(Q, K, V, attn_mask=torch.ones(8, 8, dtype=torch.bool)), ValueError, "attn_mask"),
    "attention: padding shape": (lambda: ff.attention(Q, K, V, key_padding_mask=torch.ones(2, 5, dtype=torch.bool)), ValueError, "key_padding_mask"),
    "sdpa: rank mismatch": (lambda: ff.scaled_dot_product_attention(Q, K[0], V), ValueError, "query"),
    "sdpa: mask shape": (lambda: ff.scaled_dot_product_attention(Q, Q, Q, attn_mask=torch.ones(3, 8, dtype=torch.bool)), ValueError, "attn_mask"),
    "LayerNorm module: input shape": (lambda: ff.LayerNorm((4, 16))(torch.randn(2, 16)), ValueError, "input"),
    # dtype
    "norm: integer x": (lambda: ff.layer_norm(X.long(), None, None), TypeError, "x"),
    "norm: residual dtype": (lambda: ff.add_layer_norm(X, X.double(), None, None), TypeError, "residual"),
    "norm: weight dtype": (lambda: ff.layer_norm(X, W.to(torch.int8), None), TypeError, "weight"),
    "attention: v dtype": (lambda: ff.attention(Q, K, V.double()), TypeError, "v"),
    "attention: padding dtype": (lambda: ff.attention(Q, K, V, key_padding_mask=torch.zeros(2, 9)), TypeError, "key_padding_mask"),
    "attention: mask dtype": (lambda: ff.attention(Q, K, V, attn_mask=torch.zeros(8, 9, dtype=torch.int64)), TypeError, "attn_mask"),
    "sdpa: mask dtype": (lambda: ff.scaled_dot_product_attention(Q, Q, Q, attn_mask=torch.ones(8, 8, dtype=torch.int64)), ValueError, "attn_mask"),
    "norm: not a tensor": (lambda: ff.layer_norm([1.0, 2.0], None, None), TypeError, "x"),
    "attention: not a tensor": (lambda: ff.attention(Q, K, "v"), TypeError, "v"),
    # device
    "norm: residual device": (lambda: ff.add_layer_norm(X, META, None, None), ValueError, "residual"),
    "norm: weight device": (lambda: ff.layer_norm(X, W.to("meta"), None), ValueError, "weight"),
    "attention: k device": (lambda: ff.attention(Q, K.to("meta"), V), ValueError, "k"),
    "attention: mask device": (lambda: ff.attention(Q, K, V, attn_mask=torch.zeros(8, 9, device="meta")), ValueError, "attn_mask"),
    # ranges
    "norm: negative eps": (lambda: ff.layer_norm(X, None, None, eps=-1e-5), ValueError, "eps"),
    "norm: nan eps": (lambda: ff.rms_norm(X, W, float("nan")), ValueError, "eps"),
    "attention: dropout 1": (lambda: ff.attention(Q, K, V, dropout_p=1.0), ValueError, "dropout_p"),
    "attention: dropout negative": (lambda: ff.attention(Q, K, V, dropout_p=-0.5), ValueError, "dropout_p"),
    "sdpa: dropout range": (lambda: ff.scaled_dot_product_attention(Q, Q, Q, dropout_p=2.0), ValueError, "dropout_p"),
    "attention: infinite scale": (lambda: ff.attention(Q, K, V, scale=float("inf")), ValueError, "scale"),
    # options
    "attention: causal name": (lambda: ff.attention(Q, K, V, causal="lower"), ValueError, "causal"),
    "attention: window not a pair": (lambda: ff.attention(Q, K, V, window=(3,)), ValueError, "window"),
    "attention: window int": (lambda: ff.attention(Q, K, V, window=4), ValueError, "window"),
    "attention: window below -1": (lambda: ff.attention(Q, K, V, window=(-2, 0)), ValueError, "window"),
    "attention: window float": (lambda: ff.attention(Q, K, V, window=(1.5, 2)), ValueError, "window"),
    "attention: window bool": (lambda: ff.attention(Q, K, V, window=(True, 2)), ValueError, "window"),
    "attention: softcap zero": (lambda: ff.attention(Q, K, V, softcap=0.0), ValueError, "softcap"),
    "attention: softcap negative": (lambda: ff.attention(Q, K, V, softcap=-1.0), ValueError, "softcap"),
    "attention: softcap nan": (lambda: ff.attention(Q, K, V, softcap=float("nan")), ValueError, "softcap"),
    "attention: softcap string": (lambda: ff.attention(Q, K, V, softcap="30"), TypeError, "softcap"),
    "attention: slopes shape": (lambda: ff.attention(Q, K, V, alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes"),
    "attention: slopes dtype": (lambda: ff.attention(Q, K, V, alibi_slopes=torch.ones(4, dtype=torch.float64)), TypeError, "alibi_slopes"),
    "attention: slopes device": (lambda: ff.attention(Q, K, V, alibi_slopes=torch.ones(4, device="meta")), ValueError, "alibi_slopes"),
    "attention: sinks shape": (lambda: ff.attention(Q, K, V, sinks=torch.ones(2, 4)), ValueError, "sinks"),
    "attention: sinks dtype": (lambda: ff.attention(Q, K, V, sinks=torch.ones(4, dtype=torch.int64)), TypeError, "sinks"),
    "attention: sinks device": (lambda: ff.attention(Q, K, V, sinks=torch.ones(4, device="meta")), ValueError, "sinks"),
    "attention: bias table heads": (lambda: ff.attention(Q, K, V, position_bias=ff.RelativePositionBias(torch.randn(32, 3))), ValueError, "position_bias"),
    "attention: bias table device": (lambda: ff.attention(Q, K, V, position_bias=ff.RelativePositionBias(torch.randn(32, 4, device="meta"))), ValueError, "position_bias"),
    "attention: position_bias type": (lambda: ff.attention(Q, K, V, position_bias=torch.randn(1, 4, 8, 9)), TypeError, "position_bias"),
    "attention: return_lse type": (lambda: ff.attention(Q, K, V, return_lse=1), TypeError, "return_lse"),
    "RelativePositionBias: table rank": (lambda: ff.RelativePositionBias(torch.randn(32)), ValueError, "table"),
    "RelativePositionBias: too few buckets": (lambda: ff.RelativePositionBias(torch.randn(3, 4)), ValueError, "table"),
    "RelativePositionBias: max_distance": (lambda: ff.RelativePositionBias(torch.randn(32, 4), max_distance=0), ValueError, "max_distance"),
    "norm: return_residual type": (lambda: ff.add_layer_norm(X, X, None, None, return_residual="yes"), TypeError, "return_residual"),
    "backend name": (lambda: ff.use_backend("tpu").__enter__(), ValueError, "backend"),
    # feed-forward
    "ffn: w1 shape": (lambda: ff.ffn(X, W1[:, :8], B1, W2, B2), ValueError, "w1"),
    "ffn: w2 shape": (lambda: ff.ffn(X, W1, B1, W2[:, :8], B2), ValueError, "w2"),
    "ffn: b1 shape": (lambda: ff.ffn(X, W1, B1[:3], W2, B2), ValueError, "b1"),
    "ffn: b2 shape": (lambda: ff.ffn(X, W1, B1, W2, B1), ValueError, "b2"),
    "ffn: unknown activation": (lambda: ff.ffn(X, W1, B1, W2, B2, activation="tanh"), ValueError, "activation"),
    "ffn: weight dtype": (lambda: ff.ffn(X, W1.double(), B1, W2, B2), TypeError, "w1"),
    "ffn: integer x": (lambda: ff.ffn(X.long(), W1, B1, W2, B2), TypeError, "x"),
    "ffn: dropout range": (lambda: ff.ffn(X, W1, B1, W2, B2, dropout_p=1.5), ValueError, "dropout_p"),
    "ffn: weight device": (lambda: ff.ffn(X, W1.to("meta"), B1, W2, B2), ValueError, "w1"),
    "ffn: x rank": (lambda: ff.ffn(torch.tensor(1.0), W1, B1, W2, B2), ValueError, "x"),
    "swiglu: w_up shape": (lambda: ff.swiglu_ffn(X, W1, WU[:8], W2), ValueError, "w_up"),
    "swiglu: unknown activation": (lambda: ff.swiglu_ffn(X, W1, WU, W2, activation="swish"), ValueError, "activation"),
    "swiglu: w_down dtype": (lambda: ff.swiglu_ffn(X, W1, WU, W2.half()), TypeError, "w_down"),
    "FeedForward: input size": (lambda: ff.FeedForward(16, 32)(torch.randn(3, 8)), ValueError, "x"),
    # rotary / positional
    "apply_rotary: x rank": (lambda: ff.apply_rotary(ROT_X[0], torch.randn(8, 8), torch.randn(8, 8)), ValueError, "x"),
    "RotaryEmbedding: odd dim": (lambda: ff.RotaryEmbedding(15), ValueError, "dim"),
    "LearnedPositionalEncoding: too long": (lambda: ff.LearnedPositionalEncoding(4, 16, batch_first=True)(torch.randn(2, 8, 16)), ValueError, "max_len"),
    # linear cross-entropy
    "lce: weight shape": (lambda: ff.linear_cross_entropy(LCE_X, LCE_W[:, :8], LCE_T), ValueError, "weight"),
    "lce: weight rank": (lambda: ff.linear_cross_entropy(LCE_X, LCE_W[0], LCE_T), ValueError, "weight"),
    "lce: weight dtype": (lambda: ff.linear_cross_entropy(LCE_X, LCE_W.double(), LCE_T), TypeError, "weight"),
    "lce: weight device": (lambda: ff.linear_cross_entropy(LCE_X, LCE_W.to("meta"), LCE_T), ValueError, "weight"),
    "lce: integer x": (lambda: ff.linear_cross_entropy(LCE_X.long(), LCE_W, LCE_T), TypeError, "x"),
    "lce: x without features": (lambda: ff.linear_cross_entropy(torch.randn(3, 0), LCE_W, LCE_T[0]), ValueError, "x"),
    "lce: target shape": (lambda: ff.linear_cross_entropy(LCE_X, LCE_W, LCE_T[0]), ValueError, "target"),
    "lce: target dtype": (lambda: ff.linear_cross_entropy(LCE_X, LCE_W, LCE_T.int()), TypeError, "target"),
    "lce: float target": (lambda: ff.linear_cross_entropy(LCE_X, LCE_W, LCE_T.float()), TypeError, "target"),
    "lce: target not a tensor": (lambda: ff.linear_cross_entropy(LCE_X, LCE_W, [1, 2]), TypeError, "target"),
    "lce: target above vocab": (lambda: ff.linear_cross_entropy(LCE_X, LCE_W, LCE_T.clone().fill_(10)), ValueError, "target"),
    "lce: negative target": (lambda: ff.linear_cross_entropy(LCE_X, LCE_W, LCE_T.clone().fill_(-1)), ValueError, "target"),
    "lce: bias shape": (lambda: ff.linear_cross_entropy(LCE_X, LCE_W, LCE_T, torch.randn(9)), ValueError, "bias"),
    "lce: bias dtype": (lambda: ff.linear_cross_entropy(LCE_X, LCE_W, LCE_T, torch.randn(10).half()), TypeError, "bias"),
    "lce: reduction": (lambda: ff.linear_cross_entropy(LCE_X, LCE_W, LCE_T, reduction="avg"), ValueError, "reduction"),
    "lce: softcap zero": (lambda: ff.linear_cross_entropy(LCE_X, LCE_W, LCE_T, softcap=0.0), ValueError, "softcap"),
    "lce: softcap negative": (lambda: ff.linear_cross_entropy(LCE_X, LCE_W, LCE_T, softcap=-30.0), ValueError, "softcap"),
    "lce: softcap inf": (lambda: ff.linear_cross_entropy(LCE_X, LCE_W, LCE_T, softcap=float("inf")), ValueError, "softcap"),
    "lce: label_smoothing 1": (lambda: ff.linear_cross_entropy(LCE_X, LCE_W, LCE_T, label_smoothing=1.0), ValueError, "label_smoothing"),
    "lce: label_smoothing negative": (lambda: ff.linear_cross_entropy(LCE_X, LCE_W, LCE_T, label_smoothing=-0.1), ValueError, "label_smoothing"),
    "lce: ignore_index float": (lambda: ff.linear_cross_entropy(LCE_X, LCE_W, LCE_T, ignore_index=-100.0), TypeError, "ignore_index"),
    # modules
    "MultiheadAttention: heads": (lambda: ff.MultiheadAttention(16, 3), ValueError, "num_heads"),
    "MultiheadAttention: add_bias_kv": (lambda: ff.MultiheadAttention(16, 4, add_bias_kv=True), NotImplementedError, "add_bias_kv"),
    "MultiheadAttention: query rank": (lambda: ff.MultiheadAttention(16, 4)(X[0], X[0], X[0], need_weights=False), ValueError, "query"),
    "TransformerEncoderLayer: activation": (lambda: ff.TransformerEncoderLayer(16, 4, activation="tanh"), ValueError, "activation"),
    "TransformerEncoderLayer: d_model": (lambda: ff.TransformerEncoderLayer(16, 4, 32)(torch.randn(2, 3, 8)), ValueError, "src"),
    "convert: not a module": (lambda: ff.convert("model"), TypeError, "model"),
}


@pytest.mark.parametrize("case", list(CATALOGUE))
def test_bad_input_raises_a_clear_error(case):
    call, exc, name = CATALOGUE[case]
    with pytest.raises(exc) as info:
        call()
    message = str(info.value)
    assert name in message, f"{case}: message does not name `{name}`: {message}"


def test_forced_backend_that_cannot_run_raises_value_error_with_reasons():
    with ff.use_backend("cuda"), pytest.raises(ValueError, match="cannot run attention"):
        ff.attention(Q, K, V)
