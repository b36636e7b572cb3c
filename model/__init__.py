"""The multi-head attention module (torch). Nothing on the serving path imports this package."""

from .checkpoint import CheckpointError, declared_heads, load_checkpoint, module_from_state_dict
from .mha import (
    DEFAULT_D_MODEL,
    DEFAULT_NUM_HEADS,
    DEFAULT_SEED,
    SCORE_REACH_LIMIT,
    MultiHeadAttention,
    attention_mask_4d,
    causal_mask,
    mask_exact_input_limit,
)
from .weights import from_torch_mha, load_weights, save_weights, seeded_module, to_torch_mha

__all__ = [
    "CheckpointError",
    "declared_heads",
    "load_checkpoint",
    "module_from_state_dict",
    "DEFAULT_D_MODEL",
    "DEFAULT_NUM_HEADS",
    "DEFAULT_SEED",
    "SCORE_REACH_LIMIT",
    "MultiHeadAttention",
    "attention_mask_4d",
    "causal_mask",
    "mask_exact_input_limit",
    "from_torch_mha",
    "load_weights",
    "save_weights",
    "seeded_module",
    "to_torch_mha",
]
