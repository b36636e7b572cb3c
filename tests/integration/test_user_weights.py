"""A user's own trained attention layer, saved the plain way, exported with the CLI and served.

Each module here is written as a user would write it (like the design documents, nn.MultiheadAttention,
a BERT-style encoder), trained a few steps so its weights are not the default initialisation and saved
with torch.save or safetensors. Every file is read as ``mhaserve export --weights`` reads it, into a module
that answers as the user's own; one file of each family is exported with the command, served by a real
server and called over gRPC: the answers equal the user's module's own eager output.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from mhaserve.cli import main as cli
from mhaserve.client.grpc import Client
from mhaserve.export import export_module
from mhaserve.model import MultiHeadAttention, load_checkpoint, save_weights

D, H = 32, 4
TOLERANCE = 1e-5


class DocSelfAttention(nn.Module):
    """Design document 000: W_q..W_o, forward(x, mask), -inf fill, returns (output, weights)."""

    def __init__(self, d_model, num_heads):
        super().__init__()
        self.num_heads, self.d_k = num_heads, d_model // num_heads
        self.W_q, self.W_k = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.W_v, self.W_o = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)

    def forward(self, x, mask=None):
        b, n, d = x.shape
        q, k, v = (w(x).view(b, n, self.num_heads, self.d_k).transpose(1, 2) for w in (self.W_q, self.W_k, self.W_v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_k)
        if mask is not None:
            scores = scores.masked_fill(mask == 0, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        return self.W_o((weights @ v).transpose(1, 2).contiguous().view(b, n, d)), weights


class DocAttention(nn.Module):
    """Design document 004: w_q..w_o, forward(query, key, value, mask), -1e9 fill, returns the output only."""

    def __init__(self, d_model, num_heads):
        super().__init__()
        self.num_heads, self.d_k, self.d_model = num_heads, d_model // num_heads, d_model
        self.w_q, self.w_k = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.w_v, self.w_o = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)

    def forward(self, query, key, value, mask=None):
        b = query.size(0)
        q, k, v = (
            w(x).view(b, -1, self.num_heads, self.d_k).transpose(1, 2)
            for w, x in ((self.w_q, query), (self.w_k, key), (self.w_v, value))
        )
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_k)
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        out = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).contiguous().view(b, -1, self.d_model)
        return self.w_o(out)


class Encoder(nn.Module):
    """Two layers, each holding the attention module at ``layers.N.self_attn``: a file with two candidates."""

    def __init__(self, make):
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"self_attn": make(), "norm": nn.LayerNorm(D)}) for _ in range(2))


class BertSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.query, self.key, self.value = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)


class BertAttentionOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense, self.LayerNorm = nn.Linear(D, D), nn.LayerNorm(D)


class BertAttention(nn.Module):
    """BERT's names (attention.self.query, ..., attention.output.dense). The served layer is the attention
    up to the output projection; BERT's residual and LayerNorm after it are not part of it."""

    def __init__(self):
        super().__init__()
        self.self, self.output = BertSelfAttention(), BertAttentionOutput()

    def forward(self, hidden, keep):  # keep: [B, Lk] bool, BERT's attention_mask
        additive = (1.0 - keep[:, None, None, :].float()) * torch.finfo(torch.float32).min
        return bert_attention(self.self, self.output.dense, hidden, additive)


def bert_attention(projections: BertSelfAttention, dense: nn.Linear, hidden, additive=0.0):
    b, n, _ = hidden.shape
    q, k, v = (
        p(hidden).view(b, n, H, D // H).transpose(1, 2) for p in (projections.query, projections.key, projections.value)
    )
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(D // H) + additive, dim=-1)
    return dense((weights @ v).transpose(1, 2).reshape(b, n, D)), weights


class BertModel(nn.Module):
    attention = BertAttention  # what each of its two layers' "attention" is

    def __init__(self):
        super().__init__()
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(nn.ModuleDict({"attention": self.attention()}) for _ in range(2))


class WhisperAttention(nn.Module):
    """Hugging Face's BART-style attention (BART, Marian, OPT, Whisper): q_proj..out_proj, the query scaled before
    its product with the keys; Whisper's key projection has no bias."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(D, D), nn.Linear(D, D, bias=False)
        self.v_proj, self.out_proj = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, hidden, key_value_states=None, keep=None):
        source = hidden if key_value_states is None else key_value_states
        b, n, _ = hidden.shape

        def heads(x):
            return x.view(b, -1, H, D // H).transpose(1, 2)

        q = heads(self.q_proj(hidden) * (D // H) ** -0.5)
        scores = q @ heads(self.k_proj(source)).transpose(-2, -1)
        if keep is not None:
            scores = scores.masked_fill(~keep[:, None, None, :], torch.finfo(torch.float32).min)
        weights = torch.softmax(scores, dim=-1)
        return self.out_proj((weights @ heads(self.v_proj(source))).transpose(1, 2).reshape(b, n, D)), weights


class DistilBertAttention(nn.Module):
    """DistilBERT's names (q_lin, k_lin, v_lin, out_lin), the query scaled before its product with the keys."""

    def __init__(self):
        super().__init__()
        self.q_lin, self.k_lin, self.v_lin, self.out_lin = (nn.Linear(D, D) for _ in range(4))

    def forward(self, query, key, value, mask):  # mask: [B, Lk], 1 = may attend
        b = query.shape[0]

        def heads(x):
            return x.view(b, -1, H, D // H).transpose(1, 2)

        q = heads(self.q_lin(query)) / math.sqrt(D // H)
        scores = (q @ heads(self.k_lin(key)).transpose(2, 3)).masked_fill(
            (mask == 0)[:, None, None, :], torch.finfo(torch.float32).min
        )
        weights = nn.functional.softmax(scores, dim=-1)
        return self.out_lin((weights @ heads(self.v_lin(value))).transpose(1, 2).reshape(b, -1, D)), weights


class DistilBertModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.layer = nn.ModuleList(
            nn.ModuleDict({"attention": DistilBertAttention(), "sa_layer_norm": nn.LayerNorm(D)}) for _ in range(2)
        )


class ViTAttention(nn.Module):
    """ViT's names (attention.attention.{query,key,value}, attention.output.dense); no mask."""

    def __init__(self):
        super().__init__()
        self.attention, self.output = BertSelfAttention(), BertAttentionOutput()

    def forward(self, hidden):
        return bert_attention(self.attention, self.output.dense, hidden)


class ViTModel(BertModel):
    attention = ViTAttention


class Conv1D(nn.Module):
    """GPT-2's projection: a Linear whose weight is stored input by output."""

    def __init__(self, n_out, n_in):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(n_in, n_out) * 0.1), nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return x @ self.weight + self.bias


class GPT2Attention(nn.Module):
    """GPT-2's names (c_attn: W_q, W_k, W_v side by side; c_proj). GPT-2 masks causally inside the layer; the
    served layer takes that mask with the request, like any other."""

    def __init__(self):
        super().__init__()
        self.c_attn, self.c_proj = Conv1D(3 * D, D), Conv1D(D, D)

    def forward(self, hidden, keep):  # keep: [B, Lq, Lk] bool
        b, n, _ = hidden.shape
        q, k, v = (x.view(b, n, H, D // H).transpose(1, 2) for x in self.c_attn(hidden).split(D, dim=2))
        scores = (q @ k.transpose(-2, -1) / math.sqrt(D // H)).masked_fill(~keep[:, None], float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        return self.c_proj((weights @ v).transpose(1, 2).reshape(b, n, D)), weights


class GPT2Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.h = nn.ModuleList(nn.ModuleDict({"attn": GPT2Attention(), "ln_1": nn.LayerNorm(D)}) for _ in range(2))


def trained(module: nn.Module, steps: int = 5) -> nn.Module:
    """A few Adam steps on random data, so no weight is the default initialisation any more."""
    generator = torch.Generator().manual_seed(7)
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-2)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    for _ in range(steps):
        x = torch.randn(2, 6, D, generator=generator)
        optimizer.zero_grad()
        loss = sum(p.float().pow(2).mean() for p in module.parameters()) + _call(module, x).pow(2).mean()
        loss.backward()
        optimizer.step()
    moved = [k for k, v in module.state_dict().items() if v.is_floating_point() and not torch.equal(v, before[k])]
    assert moved, "training changed no weight"
    return module.eval()


def _call(module, x):
    if isinstance(module, Encoder):
        module = module.layers[1]["self_attn"]
    if isinstance(module, ViTModel):
        return module.encoder.layer[1]["attention"](x)[0]
    if isinstance(module, BertModel):
        return module.encoder.layer[1]["attention"](x, torch.ones(x.shape[:2], dtype=torch.bool))[0]
    if isinstance(module, DistilBertModel):
        return module.transformer.layer[1]["attention"](x, x, x, torch.ones(x.shape[:2]))[0]
    if isinstance(module, GPT2Model):
        return module.h[0]["attn"](x, torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()[None])[0]
    if isinstance(module, nn.MultiheadAttention):
        return module(x, x, x)[0]
    if isinstance(module, DocAttention):
        return module(x, x, x)
    return module(x)[0]


def eager_answer(kind, module, arrays):
    """The user's module's own (output, weights or None), called the way its author would call it."""
    query = torch.from_numpy(arrays["query"])
    keep = torch.from_numpy(arrays["mask"])  # [B, Lk], True = may attend
    with torch.no_grad():
        if kind in ("mha", "mha_nobias"):
            attn = module.layers[1]["self_attn"]
            key, value = torch.from_numpy(arrays["key"]), torch.from_numpy(arrays["value"])
            out, weights = attn(query, key, value, key_padding_mask=~keep, average_attn_weights=False)
        elif kind == "bert":
            out, weights = module.encoder.layer[1]["attention"](query, keep)
        elif kind == "whisper":
            key = torch.from_numpy(arrays["key"])
            out, weights = module.layers[1]["self_attn"](query, key, keep)
        elif kind == "gpt2":
            out, weights = module.h[0]["attn"](query, keep)
        elif kind == "distilbert":
            key, value = torch.from_numpy(arrays["key"]), torch.from_numpy(arrays["value"])
            out, weights = module.transformer.layer[1]["attention"](query, key, value, keep.long())
        elif kind == "vit":
            out, weights = module.encoder.layer[1]["attention"](query)
        elif kind == "w_q":
            key, value = torch.from_numpy(arrays["key"]), torch.from_numpy(arrays["value"])
            out, weights = module(query, key, value, keep[:, None, None, :]), None
        else:  # W_q and mhaserve's own
            out, weights = module(query, keep[:, None, None, :]) if kind == "W_q" else module(query, mask=keep)
    return out.numpy(), None if weights is None else weights.numpy()


def request_arrays(kind):
    rng = np.random.default_rng(11)
    cross = kind in ("mha", "w_q", "whisper", "mha_nobias", "distilbert")
    kv_len = 9 if cross else 6
    arrays = {"query": rng.standard_normal((2, 6, D), dtype=np.float32)}
    if cross:
        arrays["key"] = rng.standard_normal((2, kv_len, D), dtype=np.float32)
        # Whisper's cross-attention projects the keys and the values from one tensor (the encoder's states)
        arrays["value"] = arrays["key"] if kind == "whisper" else rng.standard_normal((2, kv_len, D), np.float32)
    arrays["mask"] = np.arange(kv_len)[None, :] < np.array([[kv_len - 2], [kv_len]])  # every row keeps keys
    if kind == "gpt2":  # causal, as GPT-2 masks
        arrays["mask"] = np.broadcast_to(np.tril(np.ones((6, 6), dtype=bool)), (2, 6, 6)).copy()
    if kind == "vit":  # every patch attends every patch
        arrays["mask"] = np.ones((2, kv_len), dtype=bool)
    return arrays


def user_module(kind):
    torch.manual_seed({"W_q": 1, "w_q": 2, "mha": 3, "bert": 4, "mhaserve": 5, "whisper": 6, "gpt2": 7,
                       "mha_nobias": 8, "distilbert": 9, "vit": 10}[kind])  # fmt: skip
    return trained(
        {
            "W_q": lambda: DocSelfAttention(D, H),
            "w_q": lambda: DocAttention(D, H),
            "mha": lambda: Encoder(lambda: nn.MultiheadAttention(D, H, batch_first=True)),
            "mha_nobias": lambda: Encoder(lambda: nn.MultiheadAttention(D, H, bias=False, batch_first=True)),
            "whisper": lambda: Encoder(WhisperAttention),
            "gpt2": GPT2Model,
            "distilbert": DistilBertModel,
            "vit": ViTModel,
            "bert": BertModel,
            "mhaserve": lambda: MultiHeadAttention(D, H),
        }[kind]()
    )


# (kind, layout the export reports, prefix to pick, file suffix)
MATRIX = [
    ("W_q", "W_q..W_o", None, ".pt"),
    ("W_q", "W_q..W_o", None, ".safetensors"),
    ("w_q", "w_q..w_o", None, ".pth"),
    ("w_q", "w_q..w_o", None, ".safetensors"),
    ("mha", "nn.MultiheadAttention", "layers.1.self_attn.", ".bin"),
    ("mha", "nn.MultiheadAttention", "layers.1.self_attn", ".safetensors"),
    ("bert", "BERT", "encoder.layer.1.", ".pt"),
    ("bert", "BERT", "encoder.layer.1.", ".safetensors"),
    ("mha_nobias", "nn.MultiheadAttention", "layers.1.self_attn.", ".pt"),
    ("whisper", "q_proj..out_proj", "layers.1.self_attn.", ".bin"),
    ("whisper", "q_proj..out_proj", "layers.1.self_attn.", ".safetensors"),
    ("gpt2", "GPT-2", "h.0.attn.", ".pt"),
    ("gpt2", "GPT-2", "h.0.attn.", ".safetensors"),
    ("distilbert", "DistilBERT", "transformer.layer.1.attention.", ".bin"),
    ("vit", "ViT", "encoder.layer.1.", ".safetensors"),
    ("mhaserve", "mhaserve", None, ".pt"),
]


def case_id(case) -> str:
    """A MATRIX row's name: its kind and its file's suffix."""
    kind, _, _, suffix = case
    return f"{kind}{suffix}"


def save_plainly(module, path):
    if path.suffix == ".safetensors":
        save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(path))
    elif isinstance(module, MultiHeadAttention):
        save_weights(module, path)  # mhaserve's own file: the state dict with d_model and num_heads
    else:
        torch.save(module.state_dict(), path)


@pytest.mark.parametrize(("kind", "layout", "prefix", "suffix"), MATRIX, ids=map(case_id, MATRIX))
def test_every_saved_layout_is_read_into_the_served_module_equal_to_its_own(kind, layout, prefix, suffix, tmp_path):
    # What the export reads from each file, before any graph is made: the served module, called as the server
    # calls it, answers as the user's module does.
    module = user_module(kind)
    weights = tmp_path / f"attn{suffix}"
    save_plainly(module, weights)
    served, source = load_checkpoint(weights, H if kind != "mhaserve" else None, prefix)
    assert source["layout"] == layout and (served.d_model, served.num_heads) == (D, H)
    arrays = request_arrays(kind)
    want_out, want_weights = eager_answer(kind, module, arrays)
    query, keep = torch.from_numpy(arrays["query"]), torch.from_numpy(arrays["mask"])
    key, value = (torch.from_numpy(arrays[n]) if n in arrays else None for n in ("key", "value"))
    with torch.no_grad():
        out, weights_out = served(query, key, value, mask=keep)
    np.testing.assert_allclose(out.numpy(), want_out, rtol=0, atol=TOLERANCE)
    if want_weights is not None:
        np.testing.assert_allclose(weights_out.numpy(), want_weights, rtol=0, atol=TOLERANCE)


# Exported with the command and served, one file of each family: torch.save and safetensors, a prefix with and
# without its dot, self- and cross-attention, BERT's padding mask, a projection without a bias, GPT-2's causal
# mask and its weights stored input by output.
SERVED = [
    m
    for m in MATRIX
    if case_id(m) in ("W_q.pt", "w_q.safetensors", "mha.bin", "bert.safetensors", "whisper.bin", "gpt2.safetensors")
]


@pytest.mark.parametrize(("kind", "layout", "prefix", "suffix"), SERVED, ids=map(case_id, SERVED))
def test_a_trained_checkpoint_is_served_equal_to_its_module(
    start_server, kind, layout, prefix, suffix, tmp_path, capsys
):
    module = user_module(kind)
    weights = tmp_path / f"attn{suffix}"
    save_plainly(module, weights)
    out = tmp_path / "model"
    args = ["export", "--weights", str(weights), "--out", str(out), "--validation-seed", "0"]
    args += ["--heads", str(H)] if kind != "mhaserve" else []  # mhaserve's own file says how many
    args += ["--prefix", prefix] if prefix is not None else []
    assert cli(args) == 0
    stderr = capsys.readouterr().err
    assert f"read {layout} weights at prefix '{(prefix or '').rstrip('.') + ('.' if prefix else '')}'" in stderr
    assert f"d_model {D} (from the shapes), {H} heads" in stderr
    source = json.loads((out / "manifest.json").read_text())["source"]
    assert source["layout"] == layout and source["path"] == str(weights)
    if kind == "whisper":  # its key projection has no bias: served with zeros, and said so
        assert source["biases_absent"] == ["layers.1.self_attn.k_proj.bias"]
        assert "holds no layers.1.self_attn.k_proj.bias: those projections have no bias" in stderr
    else:
        assert "biases_absent" not in source
    assert source["sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()

    arrays = request_arrays(kind)
    want_out, want_weights = eager_answer(kind, module, arrays)
    server = start_server(out, "--warmup-runs", "1")
    with Client(server.url) as client:
        got = client.infer(arrays["query"], arrays.get("key"), arrays.get("value"), mask=arrays["mask"])
    np.testing.assert_allclose(got.output, want_out, rtol=0, atol=TOLERANCE)
    if want_weights is not None:
        np.testing.assert_allclose(got.attn_weights, want_weights, rtol=0, atol=TOLERANCE)


def test_export_module_validates_against_the_users_own_module(tmp_path):
    # The design document 000 module gives NaN where every key is masked: reported as undefined, not a failure.
    module = user_module("W_q")
    lines = []
    manifest = export_module(module, tmp_path / "m", validation_seed=0, report=lines.append)
    assert manifest["valid"] is True
    counts = manifest["validation"]["counts"]
    assert counts["fail"] == 0 and counts["pass"] > 0
    assert counts["skipped"] == 20  # forward(x, mask) takes no key: the cross-attention cases are not its
    undefined = [c for c in manifest["validation"]["cases"] if c["status"] == "undefined"]
    assert undefined and all("NaN on fully masked rows" in c["error"] for c in undefined)
    assert all(c["mask"] in ("masked_row", "causal") for c in undefined)
    assert manifest["source"]["class"].endswith("DocSelfAttention") and manifest["source"]["layout"] == "W_q..W_o"
    assert "undefined" in next(line for line in lines if line.startswith("validation:"))


def test_export_module_fails_when_the_served_graph_would_differ(tmp_path):
    # A module whose math is not the served one (no 1/sqrt(d_k) scaling) must fail validation, not pass.
    class Unscaled(DocAttention):
        def forward(self, query, key, value, mask=None):
            return super().forward(query * math.sqrt(self.d_k), key, value, mask)

    module = Unscaled(D, H)
    module.load_state_dict(user_module("w_q").state_dict())
    manifest = export_module(module, tmp_path / "m", validation_seed=0, report=lambda _: None)
    assert manifest["valid"] is False and manifest["validation"]["counts"]["fail"] > 0


def test_export_module_takes_an_nn_multihead_attention(tmp_path):
    attn = trained(nn.MultiheadAttention(D, H))  # batch_first=False: the reference transposes
    manifest = export_module(attn, tmp_path / "m", validation_seed=0, report=lambda _: None)
    assert manifest["valid"] is True and manifest["config"]["num_heads"] == H
    assert manifest["validation"]["counts"]["pass"] > 40


def test_export_module_takes_mhaserves_own_module_trained(tmp_path):
    # forward(query, key=None, value=None, mask=None): called with all four, so the cross-attention cases run too.
    manifest = export_module(user_module("mhaserve"), tmp_path / "m", validation_seed=0, report=lambda _: None)
    assert manifest["valid"] is True
    assert manifest["validation"]["counts"]["skipped"] == 0 and manifest["validation"]["counts"]["fail"] == 0


def test_a_pretrained_folder_is_read_and_of_sharded_weights_only_the_shard_holding_the_layer(tmp_path, capsys):
    # As Hugging Face's save_pretrained writes a model: its config.json names the heads; the index maps each
    # tensor to its shard
    model = user_module("bert")
    state = {f"bert.{k}": v.contiguous() for k, v in model.state_dict().items()}
    single = tmp_path / "single"
    single.mkdir()
    save_file(state, str(single / "model.safetensors"))
    (single / "config.json").write_text(json.dumps({"hidden_size": D, "num_attention_heads": H}))
    served, source = load_checkpoint(single, prefix="bert.encoder.layer.1.")
    assert source["heads_from"] == str(single / "config.json") and source["files"] == ["model.safetensors"]
    assert source["sha256"] == hashlib.sha256((single / "model.safetensors").read_bytes()).hexdigest()

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shards = {"model-00001-of-00002.safetensors": ".layer.0.", "model-00002-of-00002.safetensors": ".layer.1."}
    weight_map = {}
    for shard, layer in shards.items():
        save_file({k: v for k, v in state.items() if layer in k}, str(sharded / shard))
        weight_map |= {k: shard for k in state if layer in k}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (sharded / "config.json").write_text((single / "config.json").read_text())
    (sharded / "model-00001-of-00002.safetensors").write_bytes(b"never read")  # the other layer's shard
    from_shards, source = load_checkpoint(sharded, prefix="bert.encoder.layer.1.")
    assert source["files"] == ["model-00002-of-00002.safetensors"] and source["layout"] == "BERT"
    for name, tensor in served.state_dict().items():
        assert torch.equal(tensor, from_shards.state_dict()[name]), name

    # Without a prefix, the layers are listed from the index alone
    assert cli(["export", "--weights", str(sharded), "--out", str(tmp_path / "out")]) == 2
    assert "holds 2 attention layers; pick one with --prefix: 'bert.encoder.layer.0.'" in capsys.readouterr().err
    (tmp_path / "two").mkdir()
    for name in ("a.pt", "b.pt"):
        torch.save(model.state_dict(), tmp_path / "two" / name)
    assert cli(["export", "--weights", str(tmp_path / "two"), "--heads", "4", "--out", str(tmp_path / "out")]) == 2
    said = capsys.readouterr().err
    assert "a folder without model.safetensors or pytorch_model.bin or an index of shards; it holds a.pt, b.pt" in said


def write(path, state):
    torch.save(state, path)
    return path


def refusal_cases(tmp_path):
    good = DocSelfAttention(D, H).state_dict()
    two = {f"a.{k}": v for k, v in good.items()} | {f"b.{k}": v for k, v in good.items()}
    (tmp_path / "text.pt").write_text("not a checkpoint")
    (tmp_path / "cut.pt").write_bytes(write(tmp_path / "whole.pt", good).read_bytes()[:300])
    return {
        "no known attention layout": (write(tmp_path / "lin.pt", nn.Linear(D, D).state_dict()), ["--heads", "4"]),
        "holds 2 attention layers; pick one with --prefix: 'a.' (W_q..W_o), 'b.' (W_q..W_o)": (
            write(tmp_path / "two.pt", two),
            ["--heads", "4"],
        ),
        "no attention layer at prefix 'c.'": (tmp_path / "two.pt", ["--heads", "4", "--prefix", "c"]),
        "'W_k.weight' has shape [32, 16], expected a square": (
            write(tmp_path / "sq.pt", good | {"W_k.weight": torch.zeros(D, D // 2)}),
            ["--heads", "4"],
        ),
        "'W_v.weight' has shape [16, 16] while 'W_q.weight' has [32, 32]": (
            write(tmp_path / "mix.pt", good | {"W_v.weight": torch.zeros(D // 2, D // 2)}),
            ["--heads", "4"],
        ),
        "weight 'W_o.weight' is missing": (
            write(tmp_path / "noweight.pt", {k: v for k, v in good.items() if k != "W_o.weight"}),
            ["--heads", "4"],
        ),
        "'W_k.bias' holds nan at [3] (1 of 32 values not finite)": (
            write(tmp_path / "nan.pt", good | {"W_k.bias": torch.zeros(D).index_fill(0, torch.tensor(3), math.nan)}),
            ["--heads", "4"],
        ),
        # weights whose own module overflows float32: nothing to validate against
        "answers inf or NaN for unit-scale inputs (its largest weight is 1e+30": (
            write(tmp_path / "huge.pt", good | {f"W_{p}.weight": torch.full((D, D), 1e30) for p in "qk"}),
            ["--heads", "4"],
        ),
        "'k_proj.weight' has shape [8, 32], expected a square [d_model, d_model] projection (fewer key/value heads "
        "than query heads, grouped-query attention, is not served)": (
            write(
                tmp_path / "gqa.pt",
                {
                    "q_proj.weight": torch.zeros(D, D),
                    "k_proj.weight": torch.zeros(D // 4, D),
                    "v_proj.weight": torch.zeros(D // 4, D),
                    "out_proj.weight": torch.zeros(D, D),
                },
            ),
            ["--heads", "4"],
        ),  # fmt: skip
        "'q_proj_weight' is set: nn.MultiheadAttention with kdim/vdim != embed_dim": (
            write(tmp_path / "kdim.pt", nn.MultiheadAttention(D, H, kdim=16, vdim=16).state_dict()),
            ["--heads", "4"],
        ),
        "'bias_k' is set: nn.MultiheadAttention with kdim/vdim != embed_dim or add_bias_kv=True": (
            write(tmp_path / "bias_kv.pt", nn.MultiheadAttention(D, H, add_bias_kv=True).state_dict()),
            ["--heads", "4"],
        ),
        "d_model 32 (from 'W_q.weight' [32, 32]) is not divisible by 5 heads": (
            tmp_path / "whole.pt",
            ["--heads", "5"],
        ),
        "the number of heads is not in the file (a state dict's shapes do not say it); give your module's with "
        "--heads": (tmp_path / "whole.pt", []),
        "not a readable PyTorch checkpoint": (tmp_path / "cut.pt", ["--heads", "4"]),
        "not a readable PyTorch checkpoint (": (tmp_path / "text.pt", ["--heads", "4"]),
        # A pickled object is read without running its class's code: a date holds no module.
        "holds a date with no tensors, expected a module": (
            write(tmp_path / "obj.pt", datetime.date(2026, 11, 27)),
            ["--heads", "4"],
        ),
        "no such file": (tmp_path / "absent.pt", ["--heads", "4"]),
        # A crafted mhaserve file: its declared width is checked against the tensors before anything is built
        # (a module of d_model 40000 would have allocated 25 GB first).
        "'d_model' is 40000 but 'W_q.weight' has shape [32, 32]": (
            write(tmp_path / "crafted.pt", {"d_model": 40000, "num_heads": 8, "state_dict": good}),
            [],
        ),
        "not a readable safetensors file": (tmp_path / "text.pt", ["--heads", "4"]),  # renamed below
    }


def test_every_refusal_is_one_line_and_exit_code_2(tmp_path, capsys):
    for expected, (path, extra) in refusal_cases(tmp_path).items():
        if expected.startswith("not a readable safetensors"):
            path = path.rename(path.with_suffix(".safetensors"))
        assert cli(["export", "--weights", str(path), "--out", str(tmp_path / "out"), *extra]) == 2, expected
        err = capsys.readouterr().err
        assert expected in err and len(err.strip().splitlines()) == 1, (expected, err)
        assert err.startswith("mhaserve export: error: ")
    assert not (tmp_path / "out").exists()


def test_a_refusal_from_the_real_command_has_no_traceback(tmp_path):
    path = write(tmp_path / "lin.pt", nn.Linear(D, D).state_dict())
    done = subprocess.run(
        [sys.executable, "-m", "mhaserve.cli", "export", "--weights", str(path), "--heads", "4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and "no known attention layout" in done.stderr


def test_a_module_whose_weights_are_all_zero_exports_and_validates(tmp_path):
    # Its every answer is zero: errors are taken against a reference whose largest magnitude is 0.
    module = MultiHeadAttention(D, H)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.zero_()
    manifest = export_module(module, tmp_path / "m", validation_seed=0, report=lambda _: None)
    assert manifest["valid"] is True
