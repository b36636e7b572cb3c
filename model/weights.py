"""Weights of the MHA module: the seeded default, state-dict files, and torch.nn.MultiheadAttention."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .checkpoint import load_checkpoint
from .mha import DEFAULT_D_MODEL, DEFAULT_NUM_HEADS, DEFAULT_SEED, MultiHeadAttention


def seeded_module(
    d_model: int = DEFAULT_D_MODEL, num_heads: int = DEFAULT_NUM_HEADS, seed: int = DEFAULT_SEED
) -> MultiHeadAttention:
    """The module with nn.Linear's default initialisation drawn from a fixed seed: same weights every time."""
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        module = MultiHeadAttention(d_model, num_heads)
    finally:
        torch.random.set_rng_state(generator_state)
    return module.eval()


def save_weights(module: MultiHeadAttention, path: str | Path) -> None:
    """Write the state dict with the configuration needed to rebuild the module: a torch.save file, or for a
    ``.safetensors`` path a safetensors file with ``d_model`` and ``num_heads`` in its metadata."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        sizes = {"d_model": str(module.d_model), "num_heads": str(module.num_heads)}
        save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(path), metadata=sizes)
        return
    torch.save({"d_model": module.d_model, "num_heads": module.num_heads, "state_dict": module.state_dict()}, path)


def load_weights(path: str | Path) -> MultiHeadAttention:
    """Rebuild a module from a file written by save_weights (or any checkpoint that names its heads)."""
    return load_checkpoint(path)[0]


def to_torch_mha(module: MultiHeadAttention) -> nn.MultiheadAttention:
    """An equivalent batch-first nn.MultiheadAttention (in_proj is W_q, W_k, W_v stacked).

    Its boolean attn_mask and key_padding_mask mean True = masked, the opposite of ours.
    """
    torch_mha = nn.MultiheadAttention(module.d_model, module.num_heads, bias=True, batch_first=True)
    with torch.no_grad():
        torch_mha.in_proj_weight.copy_(torch.cat([module.W_q.weight, module.W_k.weight, module.W_v.weight]))
        torch_mha.in_proj_bias.copy_(torch.cat([module.W_q.bias, module.W_k.bias, module.W_v.bias]))
        torch_mha.out_proj.weight.copy_(module.W_o.weight)
        torch_mha.out_proj.bias.copy_(module.W_o.bias)
    return torch_mha.eval()


def from_torch_mha(torch_mha: nn.MultiheadAttention) -> MultiHeadAttention:
    """Our module with the weights of an nn.MultiheadAttention that has one packed in_proj and biases."""
    if not torch_mha._qkv_same_embed_dim or torch_mha.in_proj_bias is None:
        raise ValueError("only nn.MultiheadAttention with kdim == vdim == embed_dim and bias=True converts")
    if torch_mha.bias_k is not None:
        raise ValueError("nn.MultiheadAttention with add_bias_kv=True has no equivalent here")
    d = torch_mha.embed_dim
    module = MultiHeadAttention(d, torch_mha.num_heads)
    w_q, w_k, w_v = torch_mha.in_proj_weight.detach().split(d)
    b_q, b_k, b_v = torch_mha.in_proj_bias.detach().split(d)
    with torch.no_grad():
        for linear, weight, bias in ((module.W_q, w_q, b_q), (module.W_k, w_k, b_k), (module.W_v, w_v, b_v)):
            linear.weight.copy_(weight)
            linear.bias.copy_(bias)
        module.W_o.weight.copy_(torch_mha.out_proj.weight)
        module.W_o.bias.copy_(torch_mha.out_proj.bias)
    return module.eval()
