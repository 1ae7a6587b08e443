"""fastformer: fused Transformer kernels (attention, add+norm, FFN) with CPU, CUDA, Triton and
reference backends behind one API. See README.md and ``fastformer.info()``.

Importing fastformer does no GPU work and does not import triton.
"""
__version__ = "0.1.0"

from . import backends  # noqa: E402
from ._info import info  # noqa: E402
from .backends import available_backends, last_dispatch, use_backend  # noqa: E402
from .convert import convert  # noqa: E402
from .modules.attention import MultiheadAttention  # noqa: E402
from .modules.ffn import FeedForward, SwiGLU  # noqa: E402
from .modules.norm import LayerNorm, RMSNorm  # noqa: E402
from .modules.positional import (LearnedPositionalEncoding, RotaryEmbedding,  # noqa: E402
                                 SinusoidalPositionalEncoding)
from .modules.transformer import (Transformer, TransformerDecoder,  # noqa: E402
                                  TransformerDecoderLayer, TransformerEncoder,
                                  TransformerEncoderLayer)
from .ops.attention import RelativePositionBias, attention  # noqa: E402
from .ops.ffn import ffn, swiglu_ffn  # noqa: E402
from .ops.linear_cross_entropy import linear_cross_entropy  # noqa: E402
from .ops.moe import moe_ffn  # noqa: E402
from .ops.norm import add_layer_norm, layer_norm, rms_norm  # noqa: E402
from .ops.rotary import apply_rotary  # noqa: E402
from .ops.sdpa import SDPAError, patch_sdpa, scaled_dot_product_attention  # noqa: E402
from .ops.varlen import attention_with_kvcache, varlen_attention  # noqa: E402

__all__ = [
    "__version__", "backends", "info", "available_backends", "last_dispatch", "use_backend",
    "add_layer_norm", "layer_norm", "rms_norm", "LayerNorm", "RMSNorm",
    "attention", "RelativePositionBias", "scaled_dot_product_attention", "varlen_attention",
    "attention_with_kvcache", "patch_sdpa", "SDPAError",
    "ffn", "swiglu_ffn", "moe_ffn", "apply_rotary", "linear_cross_entropy",
    "MultiheadAttention", "TransformerEncoderLayer", "TransformerDecoderLayer",
    "TransformerEncoder", "TransformerDecoder", "Transformer",
    "SinusoidalPositionalEncoding", "LearnedPositionalEncoding", "RotaryEmbedding",
    "convert", "FeedForward", "SwiGLU",
]
