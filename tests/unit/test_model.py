"""The MHA module: shapes, masks, the fully masked row, weights, and agreement with independent references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mhaserve.model import (
    MultiHeadAttention,
    causal_mask,
    from_torch_mha,
    load_weights,
    save_weights,
    seeded_module,
    to_torch_mha,
)


def reference_float64(module, query, key, value, allowed=None):
    """The formula in numpy float64 with the module's weights: an implementation apart from forward()."""
    w = {name: p.detach().double().numpy() for name, p in module.named_parameters()}
    h, d_k = module.num_heads, module.d_k

    def heads(x, proj):
        y = x.astype(np.float64) @ w[f"{proj}.weight"].T + w[f"{proj}.bias"]
        return y.reshape(y.shape[0], y.shape[1], h, d_k).transpose(0, 2, 1, 3)

    q, k, v = heads(query, "W_q"), heads(key, "W_k"), heads(value, "W_v")
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d_k)
    if allowed is not None:
        scores = np.where(allowed, scores, -np.inf)
    with np.errstate(invalid="ignore"):
        e = np.exp(scores - scores.max(axis=-1, keepdims=True))
        weights = e / e.sum(axis=-1, keepdims=True)
    weights = np.nan_to_num(weights, nan=0.0)
    context = (weights @ v).transpose(0, 2, 1, 3).reshape(query.shape[0], query.shape[1], -1)
    output = context @ w["W_o.weight"].T + w["W_o.bias"]
    if allowed is not None:
        output = output * np.broadcast_to(allowed, weights.shape).any(axis=(1, 3))[..., None]
    return output, weights


def run(module, *args):
    with torch.no_grad():
        return module(*(None if a is None else torch.as_tensor(a) for a in args))


def test_d_model_must_divide_into_heads():
    with pytest.raises(ValueError, match="divisible by num_heads.*d_model=10, num_heads=3"):
        MultiHeadAttention(10, 3)


@pytest.mark.parametrize("d_model,heads", [(512, 8), (768, 12), (64, 4)])
def test_shapes_self_and_cross_attention(d_model, heads):
    m = seeded_module(d_model, heads)
    x = torch.randn(2, 5, d_model)
    out, attn = run(m, x)
    assert out.shape == (2, 5, d_model) and attn.shape == (2, heads, 5, 5)
    kv = torch.randn(2, 9, d_model)
    out, attn = run(m, x, kv, kv)
    assert out.shape == (2, 5, d_model) and attn.shape == (2, heads, 5, 9)


def test_key_absent_is_self_attention():
    m = seeded_module(64, 4)
    x = torch.randn(3, 6, 64)
    torch.testing.assert_close(run(m, x), run(m, x, x, x), rtol=0, atol=0)


def test_worked_example_derived_in_float64():
    """d_model=2, one head, identity projections, zero biases: every number below is derived by hand."""
    m = MultiHeadAttention(2, 1)
    with torch.no_grad():
        for lin in (m.W_q, m.W_k, m.W_v, m.W_o):
            lin.weight.copy_(torch.eye(2))
            lin.bias.zero_()
    x = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    # scores = x x^T / sqrt(2) = [[1/sqrt2, 0], [0, 1/sqrt2]]; softmax of [1/sqrt2, 0]:
    p = math.exp(1 / math.sqrt(2)) / (math.exp(1 / math.sqrt(2)) + 1.0)  # 0.669761...
    assert p == pytest.approx(0.6697615493266569, abs=1e-15)
    out, attn = run(m, x)
    expected_attn = torch.tensor([[[[p, 1 - p], [1 - p, p]]]])
    expected_out = torch.tensor([[[p, 1 - p], [1 - p, p]]])  # weights @ V with V = x = I
    torch.testing.assert_close(attn, expected_attn, rtol=0, atol=1e-7)
    torch.testing.assert_close(out, expected_out, rtol=0, atol=1e-7)


@pytest.mark.parametrize("d_model,heads", [(512, 8), (768, 12)])
def test_matches_float64_formula(d_model, heads):
    m = seeded_module(d_model, heads, seed=3)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 7, d_model), dtype=np.float32)
    kv = rng.standard_normal((2, 11, d_model), dtype=np.float32)
    allowed = rng.random((2, 1, 7, 11)) < 0.7
    allowed[1, 0, 3, :] = False
    out, attn = run(m, q, kv, kv, allowed)
    ref_out, ref_attn = reference_float64(m, q, kv, kv, allowed)
    np.testing.assert_allclose(out.numpy(), ref_out, rtol=0, atol=2e-6)
    np.testing.assert_allclose(attn.numpy(), ref_attn, rtol=0, atol=2e-6)


def test_matches_torch_multihead_attention_with_same_weights():
    m = seeded_module(512, 8, seed=5)
    torch_mha = to_torch_mha(m)
    q, kv = torch.randn(3, 10, 512), torch.randn(3, 13, 512)
    padding = torch.ones(3, 13, dtype=torch.bool)
    padding[1, 9:] = False
    out, attn = run(m, q, kv, kv, padding)
    with torch.no_grad():
        # nn.MultiheadAttention's boolean masks mean True = masked: the opposite of ours.
        t_out, t_attn = torch_mha(q, kv, kv, key_padding_mask=~padding, need_weights=True, average_attn_weights=False)
    torch.testing.assert_close(out, t_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(attn, t_attn, rtol=0, atol=1e-5)

    causal = causal_mask(10)
    out, attn = run(m, q, q, q, causal)
    with torch.no_grad():
        t_out, t_attn = torch_mha(q, q, q, attn_mask=~causal[0], need_weights=True, average_attn_weights=False)
    torch.testing.assert_close(out, t_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(attn, t_attn, rtol=0, atol=1e-5)


def test_torch_multihead_attention_round_trip():
    m = seeded_module(64, 4, seed=7)
    back = from_torch_mha(to_torch_mha(m))
    for name, p in m.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], p, rtol=0, atol=0)


def test_mask_ranks_and_dtypes_agree():
    m = seeded_module(64, 4)
    q, kv = torch.randn(2, 5, 64), torch.randn(2, 6, 64)
    padding = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    expected = run(m, q, kv, kv, padding.bool())
    for mask in (
        padding,  # integer [B, Lk]
        padding.bool()[:, None, :].expand(2, 5, 6),  # [B, Lq, Lk]
        padding.bool()[:, None, None, :].expand(2, 1, 5, 6),  # [B, 1, Lq, Lk]
        padding.to(torch.int64)[:, None, None, :],  # [B, 1, 1, Lk]
    ):
        torch.testing.assert_close(run(m, q, kv, kv, mask), expected, rtol=0, atol=0)
    # masked keys get exactly zero weight
    assert torch.all(expected[1][0, :, :, 3:] == 0)


def test_mask_of_wrong_rank_is_a_clear_error():
    m = seeded_module(64, 4)
    x = torch.randn(1, 3, 64)
    with pytest.raises(ValueError, match=r"mask must have rank 2 .* got \(3,\)"):
        run(m, x, x, x, torch.ones(3))


def test_fully_masked_row_is_zero_not_nan():
    m = seeded_module(64, 4)
    x = torch.randn(2, 4, 64)
    allowed = torch.ones(2, 4, 4, dtype=torch.bool)
    allowed[0, 2, :] = False
    out, attn = run(m, x, x, x, allowed)
    assert not torch.isnan(out).any() and not torch.isnan(attn).any()
    assert torch.all(attn[0, :, 2] == 0) and torch.all(out[0, 2] == 0)
    # the other rows are untouched by the special case
    ref_out, ref_attn = reference_float64(m, x.numpy(), x.numpy(), x.numpy(), allowed[:, None].numpy())
    np.testing.assert_allclose(out.numpy(), ref_out, atol=2e-6)
    np.testing.assert_allclose(attn.numpy(), ref_attn, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_fully_masked_row_is_zero_in_every_float_dtype(dtype):
    # Large inputs give scores far from zero: a masking bias near float16's limit would overflow to -inf.
    m = seeded_module(64, 4).to(dtype)
    x = (torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(0)) * 30).to(dtype)
    key_padding = torch.ones(2, 5, dtype=torch.bool)
    key_padding[1] = False  # every key of the second item masked
    key_padding[0, 3:] = False
    out, attn = run(m, x, x, x, key_padding)
    assert out.dtype == attn.dtype == dtype
    assert not torch.isnan(out).any() and not torch.isnan(attn).any()
    assert torch.all(attn[1] == 0) and torch.all(out[1] == 0)
    assert torch.all(attn[0, ..., 3:] == 0)  # masked keys get exactly zero weight
    torch.testing.assert_close(attn[0].sum(-1).float(), torch.ones(4, 5), rtol=0, atol=1e-2)


def test_causal_mask():
    assert causal_mask(3).tolist() == [[[True, False, False], [True, True, False], [True, True, True]]]
    # Lk > Lq: aligned at the end (queries are the last Lq positions)
    assert causal_mask(2, 4).tolist() == [[[True, True, True, False], [True, True, True, True]]]


def test_dropout_only_in_training():
    m = MultiHeadAttention(64, 4, dropout=0.5)
    x = torch.randn(1, 8, 64)
    m.eval()
    torch.testing.assert_close(run(m, x), run(m, x), rtol=0, atol=0)
    m.train()
    torch.manual_seed(0)
    with torch.no_grad():
        train_out, train_attn = m(x)
    eval_out, eval_attn = run(m.eval(), x)
    # dropout acts on the weights that multiply V; the returned weights stay the softmax
    assert not torch.allclose(train_out, eval_out)
    torch.testing.assert_close(train_attn, eval_attn, rtol=0, atol=0)
    with pytest.raises(ValueError, match="dropout"):
        MultiHeadAttention(64, 4, dropout=1.0)


def test_seeded_module_is_deterministic_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = seeded_module(64, 4, seed=9)
    after = torch.rand(1)
    b = seeded_module(64, 4, seed=9)
    assert torch.equal(before, after)
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    assert not torch.equal(a.W_q.weight, seeded_module(64, 4, seed=10).W_q.weight)


def test_weights_file_round_trip(tmp_path):
    m = seeded_module(768, 12, seed=2)
    save_weights(m, tmp_path / "w.pt")
    back = load_weights(tmp_path / "w.pt")
    assert (back.d_model, back.num_heads) == (768, 12)
    x = torch.randn(1, 3, 768)
    torch.testing.assert_close(run(back, x), run(m, x), rtol=0, atol=0)
    # a bare state dict does not say how many heads it has
    torch.save(m.state_dict(), tmp_path / "bare.pt")
    with pytest.raises(ValueError, match="number of heads is not in the file"):
        load_weights(tmp_path / "bare.pt")
