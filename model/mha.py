"""The multi-head attention module served by mhaserve.

softmax(Q K^T / sqrt(d_k)) V per head, with separate W_q, W_k, W_v, W_o projections (each
``nn.Linear(d_model, d_model)`` with bias), heads concatenated before W_o.

Masks follow one rule everywhere: a mask value of 0 (or False) means "may not attend".
A query row whose keys are all masked gets attention weights of zero and an output of zero
(plain softmax would give NaN there). A masked key gets exactly zero weight for inputs up to
mask_exact_input_limit, which the server enforces.
"""

from __future__ import annotations

import math

import torch
from torch import nn

DEFAULT_D_MODEL = 512
DEFAULT_NUM_HEADS = 8
DEFAULT_SEED = 0

# A mask is a bias of half float32's lowest value. While every raw score q.k lies within +-2**125, a masked key's
# biased score stays below every allowed one by more than 1e38, so exp() makes its weight exactly 0; past that, an
# allowed score that overflowed to -inf (or fell below -1.7e38) would lose to a masked key, every value still
# finite. mask_exact_input_limit turns this into a largest input magnitude, which the server enforces.
SCORE_REACH_LIMIT = 2.0**125


class MultiHeadAttention(nn.Module):
    """Scaled dot-product attention over ``num_heads`` heads of size ``d_model // num_heads``."""

    def __init__(self, d_model: int = DEFAULT_D_MODEL, num_heads: int = DEFAULT_NUM_HEADS, dropout: float = 0.0):
        super().__init__()
        if d_model <= 0 or num_heads <= 0:
            raise ValueError(f"d_model and num_heads must be positive, got d_model={d_model}, num_heads={num_heads}")
        if d_model % num_heads != 0:
            raise ValueError(
                f"d_model must be divisible by num_heads: d_model={d_model}, num_heads={num_heads} "
                f"leaves a remainder of {d_model % num_heads}"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.d_model = d_model
        self.num_heads = num_heads
        self.d_k = d_model // num_heads
        self.W_q = nn.Linear(d_model, d_model)
        self.W_k = nn.Linear(d_model, d_model)
        self.W_v = nn.Linear(d_model, d_model)
        self.W_o = nn.Linear(d_model, d_model)
        # Applied to the attention weights in training only; eval() and export leave it out.
        self.attn_dropout = nn.Dropout(dropout)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attend from ``query`` [B, Lq, d_model] to ``key``/``value`` [B, Lk, d_model].

        ``key`` absent means self-attention (key = value = query); ``value`` absent means value = key.
        ``mask`` (bool or integer, 0 = may not attend) is [B, Lk] (key padding), [B, Lq, Lk] or
        anything that broadcasts to [B, h, Lq, Lk]. Returns ``(output [B, Lq, d_model],
        attn_weights [B, h, Lq, Lk])``.
        """
        if key is None:
            key = query
        if value is None:
            value = key
        q = self._split_heads(self.W_q(query))
        k = self._split_heads(self.W_k(key))
        v = self._split_heads(self.W_v(value))

        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        if mask is None:
            weights = torch.softmax(scores, dim=-1)
            rows_attending = None
        elif torch.compiler.is_exporting():
            # One opaque op for torch.export (see masked_softmax_op), so the mask's dims stay free.
            weights, rows_attending = masked_softmax_op(scores, attention_mask_4d(mask))
        else:
            weights, rows_attending = masked_softmax(scores, attention_mask_4d(mask))
        # Dropout (training only) acts on what multiplies V; the returned weights stay the softmax.
        context = torch.matmul(self.attn_dropout(weights), v)
        output = self.W_o(self._merge_heads(context))
        if rows_attending is not None:
            # Zero the output of a query row that no head may attend from (W_o alone would give its bias).
            output = scale_rows_op(output, rows_attending) if torch.compiler.is_exporting() else output * rows_attending
        return output, weights

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        # [B, L, d_model] -> [B, h, L, d_k]
        return _reshape_last_dim(x, (self.num_heads, self.d_k)).transpose(1, 2)

    def _merge_heads(self, x: torch.Tensor) -> torch.Tensor:
        # [B, h, L, d_k] -> [B, L, d_model]
        return _reshape_last_dim(x.transpose(1, 2), (self.d_model,))


def _reshape_last_dim(x: torch.Tensor, tail: tuple[int, ...]) -> torch.Tensor:
    """[B, L, ...] -> [B, L, *tail]. Exported, one Reshape to a constant shape whose 0s keep the input's B
    and L (reshape_op): torch.export would compute B and L with Shape and Concat nodes, each a few
    microseconds in ONNX Runtime whatever its size (27 of 61 nodes in the first traced graph)."""
    if torch.compiler.is_exporting():
        return reshape_op(x, list(tail))
    return x.reshape(*x.shape[:2], *tail)


def masked_softmax(scores: torch.Tensor, allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax over keys where ``allowed`` (bool, broadcastable to scores), and which query rows attend at all.

    Returns the weights (zero on a row with every key masked) and a [B or 1, Lq or 1, 1] factor, 1 where a
    query row may attend to some key in some head, else 0.
    """
    allowed = allowed.to(scores.dtype)  # 1 = may attend, 0 = may not
    # The mask becomes an additive bias at its own (small, broadcast) shape: half the lowest finite value,
    # which exp() turns into exactly 0 as -inf would, which a score cannot push past -inf (float16's lowest
    # plus -20 would overflow), and which leaves a row with every key masked finite instead of NaN. One
    # broadcast Add over the scores replaces a full-size select (measured when it was
    # chosen).
    bias = (1 - allowed) * (torch.finfo(scores.dtype).min / 2)
    # A row with every key masked is defined as zeros: multiply by whether the row attends at all
    # (a max over 0/1 rather than any(), which exports as three nodes and a cast back).
    attends = allowed.amax(dim=-1, keepdim=True)  # [B or 1, h or 1, Lq or 1, 1]
    return torch.softmax(scores + bias, dim=-1) * attends, attends.amax(dim=1)


# Opaque to torch.export, translated to ONNX by export/onnx_export.py. torch.export proves shapes with
# guards: broadcasting the mask [1 or B, 1, 1 or Lq, Lk] against the scores in torch code would either
# fix its batch to 1 or tie it to the query's batch. Inside a custom op whose declared outputs have the
# scores' (or the mask's own) shape, no such guard is made, and ONNX broadcasts at run time.
@torch.library.custom_op("mhaserve::masked_softmax", mutates_args=())
def masked_softmax_op(scores: torch.Tensor, allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return masked_softmax(scores, allowed)


@masked_softmax_op.register_fake
def _(scores, allowed):
    rows = allowed.new_empty((allowed.shape[0], allowed.shape[2], 1), dtype=scores.dtype)
    return torch.empty_like(scores), rows


@torch.library.custom_op("mhaserve::scale_rows", mutates_args=())
def scale_rows_op(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    return x * factor


@scale_rows_op.register_fake
def _(x, factor):
    return torch.empty_like(x)


@torch.library.custom_op("mhaserve::reshape_keeping_batch_and_length", mutates_args=())
def reshape_op(x: torch.Tensor, tail: list[int]) -> torch.Tensor:
    return x.reshape(*x.shape[:2], *tail).clone()  # a custom op may not return a view of its input


@reshape_op.register_fake
def _(x, tail):
    return x.new_empty((x.shape[0], x.shape[1], *tail))


def mask_exact_input_limit(module: MultiHeadAttention) -> float:
    """The largest input magnitude m up to which every raw score q.k stays within SCORE_REACH_LIMIT, so that a mask
    decides exactly (masked keys get weight 0): |q.k| <= d_k * max|q| * max|k|, and max|q| <= A_q * m + B_q with A_q
    the largest row sum of |W_q| and B_q the largest |b_q| (the same for k). Computed in float64, rounded down."""

    def reach(layer: nn.Linear) -> tuple[float, float]:
        weight, bias = layer.weight.detach().double(), layer.bias.detach().double()
        return float(weight.abs().sum(dim=1).max()), float(bias.abs().max())

    (a_q, b_q), (a_k, b_k) = reach(module.W_q), reach(module.W_k)
    # d_k (a_q m + b_q)(a_k m + b_k) = limit, for m > 0
    a = module.d_k * a_q * a_k
    b = module.d_k * (a_q * b_k + a_k * b_q)
    c = module.d_k * b_q * b_k - SCORE_REACH_LIMIT
    if a == 0:
        return math.inf  # the scores do not depend on the inputs
    return 0.99 * (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)


def attention_mask_4d(mask: torch.Tensor) -> torch.Tensor:
    """A boolean "may attend" mask of rank 4, broadcastable to [B, h, Lq, Lk].

    Rank 2 is key padding [B, Lk]; rank 3 is [B, Lq, Lk]; rank 4 is taken as [B, h, Lq, Lk].
    """
    allowed = mask if mask.dtype == torch.bool else mask != 0
    if allowed.dim() == 2:
        return allowed[:, None, None, :]
    if allowed.dim() == 3:
        return allowed[:, None, :, :]
    if allowed.dim() == 4:
        return allowed
    raise ValueError(f"mask must have rank 2 ([B, Lk]), 3 ([B, Lq, Lk]) or 4 ([B, h, Lq, Lk]); got {tuple(mask.shape)}")


def causal_mask(q_len: int, kv_len: int | None = None, device: torch.device | None = None) -> torch.Tensor:
    """A [1, Lq, Lk] bool mask letting query i attend to keys 0..i (aligned at the end when Lk > Lq)."""
    kv_len = q_len if kv_len is None else kv_len
    offset = kv_len - q_len
    rows = torch.arange(q_len, device=device)[:, None]
    cols = torch.arange(kv_len, device=device)[None, :]
    return (cols <= rows + offset).unsqueeze(0)
