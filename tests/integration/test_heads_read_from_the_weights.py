"""A state dict's shapes give d_model but not the number of heads, and a wrong count exports, validates against
those weights and serves a model unlike the user's. So wherever the weights say their heads (a whole saved module,
a config.json beside them, the metadata of the files mhaserve writes) the count is read from there, and a
``--heads`` that contradicts it is refused; where nothing says it, the export says that it took ``--heads`` on
trust."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from mhaserve.cli import main as cli
from mhaserve.export import export_module
from mhaserve.model import CheckpointError, MultiHeadAttention, load_checkpoint, save_weights

D = 32


class DocSelfAttention(nn.Module):
    """The design documents' module, with its heads in ``self.h``."""

    constructed = 0
    restored = 0

    def __init__(self, d_model, h):
        super().__init__()
        DocSelfAttention.constructed += 1
        self.h = h
        self.W_q, self.W_k = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.W_v, self.W_o = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)

    def __setstate__(self, state):  # would run if the file were unpickled the ordinary way
        DocSelfAttention.restored += 1
        super().__setstate__(state)

    def forward(self, x, mask=None):
        return attention(self, x, mask, self.h)


def attention(module, x, mask, heads):
    b, n, d = x.shape
    q, k, v = (w(x).view(b, n, heads, d // heads).transpose(1, 2) for w in (module.W_q, module.W_k, module.W_v))
    scores = q @ k.transpose(-2, -1) / (d // heads) ** 0.5
    if mask is not None:
        scores = scores.masked_fill(mask == 0, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return module.W_o((weights @ v).transpose(1, 2).reshape(b, n, d)), weights


class Block(nn.Module):
    """A transformer block holding nn.MultiheadAttention at ``attn``."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, 8, batch_first=True)


def test_a_whole_saved_module_gives_its_heads_and_runs_none_of_its_code(tmp_path):
    module = DocSelfAttention(D, 8)
    torch.save(module, tmp_path / "model.pt")
    before = (DocSelfAttention.constructed, DocSelfAttention.restored)

    served, source = load_checkpoint(tmp_path / "model.pt")

    assert (DocSelfAttention.constructed, DocSelfAttention.restored) == before
    assert served.num_heads == 8 and source["heads_from"] == "the saved module"
    assert source["module_class"].endswith("DocSelfAttention")
    assert torch.equal(served.W_o.weight, module.W_o.weight) and torch.equal(served.W_k.bias, module.W_k.bias)
    with pytest.raises(CheckpointError, match="the saved module says 8 heads, --heads says 4"):
        load_checkpoint(tmp_path / "model.pt", num_heads=4)


def test_a_saved_block_gives_the_heads_of_its_attention_layer(tmp_path):
    torch.save(Block(), tmp_path / "block.pt")
    served, source = load_checkpoint(tmp_path / "block.pt")
    assert (served.num_heads, source["prefix"], source["layout"]) == (8, "attn.", "nn.MultiheadAttention")


def test_a_config_json_beside_a_state_dict_gives_its_heads(tmp_path):
    torch.save(DocSelfAttention(D, 8).state_dict(), tmp_path / "attn.pt")
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": D, "num_attention_heads": 8}))

    served, source = load_checkpoint(tmp_path / "attn.pt")
    assert served.num_heads == 8 and source["heads_from"] == str(tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="config.json says 8 heads, --heads says 4"):
        load_checkpoint(tmp_path / "attn.pt", num_heads=4)

    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 768, "num_attention_heads": 12}))
    with pytest.raises(CheckpointError, match="says a model size of 768, while attn.pt holds d_model 32"):
        load_checkpoint(tmp_path / "attn.pt", num_heads=8)


def test_an_encoder_decoders_config_gives_each_side_its_own_heads(tmp_path):
    # BART's config.json names the encoder's and the decoder's head counts apart
    layers = {f"model.{side}.layers.0.self_attn.": DocSelfAttention(D, 4) for side in ("encoder", "decoder")}
    state = {f"{prefix}{proj}.{kind}": getattr(module, f"W_{proj[0]}").get_parameter(kind).detach()
             for prefix, module in layers.items() for proj in ("q_proj", "k_proj", "v_proj", "out_proj")
             for kind in ("weight", "bias")}  # fmt: skip
    save_file(state, str(tmp_path / "model.safetensors"))
    config = {"d_model": D, "encoder_attention_heads": 4, "decoder_attention_heads": 8}
    (tmp_path / "config.json").write_text(json.dumps(config))
    for side, heads in (("encoder", 4), ("decoder", 8)):
        served, _ = load_checkpoint(tmp_path, prefix=f"model.{side}.layers.0.self_attn.")
        assert served.num_heads == heads, side


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_weights_mhaserve_writes_carry_their_heads(tmp_path, suffix):
    save_weights(MultiHeadAttention(D, 8), tmp_path / f"attn{suffix}")
    assert load_checkpoint(tmp_path / f"attn{suffix}")[0].num_heads == 8
    with pytest.raises(CheckpointError, match="the file says 8 heads, --heads says 4"):
        load_checkpoint(tmp_path / f"attn{suffix}", num_heads=4)


def test_safetensors_metadata_from_the_users_own_save_is_read(tmp_path):
    state = {k: v.contiguous() for k, v in DocSelfAttention(D, 4).state_dict().items()}
    save_file(state, str(tmp_path / "attn.safetensors"), metadata={"num_heads": "4"})
    with pytest.raises(CheckpointError, match="the file says 4 heads, --heads says 8"):
        load_checkpoint(tmp_path / "attn.safetensors", num_heads=8)


def test_export_module_refuses_a_num_heads_its_module_contradicts(tmp_path):
    with pytest.raises(ValueError, match="DocSelfAttention has 8 heads, num_heads=4 says otherwise"):
        export_module(DocSelfAttention(D, 8), tmp_path / "m", num_heads=4)
    assert not (tmp_path / "m").exists()


def test_the_export_says_when_the_heads_are_taken_on_trust(tmp_path, capsys):
    torch.save(DocSelfAttention(D, 8).state_dict(), tmp_path / "attn.pt")
    refused = cli(["export", "--weights", str(tmp_path / "attn.pt"), "--heads", "3", "--out", str(tmp_path / "m")])
    assert refused == 2 and "not divisible by 3 heads" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"d_model": D, "nhead": 8}))
    assert cli(["export", "--weights", str(tmp_path / "attn.pt"), "--heads", "4", "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "config.json says 8 heads, --heads says 4" in err
    (tmp_path / "config.json").unlink()
    assert cli(["export", "--weights", str(tmp_path / "attn.pt"), "--heads", "8", "--out", str(tmp_path / "m")]) == 0
    err = capsys.readouterr().err
    assert "8 heads (from --heads)" in err and "does not say its number of heads" in err


class MisnamedHeads(DocSelfAttention):
    """A module whose attribute says 8 heads while its forward splits into 4: its own answers are the truth."""

    def forward(self, x, mask=None):
        return attention(self, x, mask, 4)


def test_trust_module_validates_against_the_saved_module_itself(tmp_path, capsys):
    torch.manual_seed(3)
    torch.save(MisnamedHeads(D, 8), tmp_path / "model.pt")
    export = ["export", "--weights", str(tmp_path / "model.pt"), "--validation-seed", "0"]
    # Read without running it: 8 heads from its attribute, validated against those weights in 8 heads: valid.
    assert cli([*export, "--out", str(tmp_path / "by-weights")]) == 0
    # Loaded and run (--trust-module): its own answers differ, and the export says so.
    assert cli([*export, "--trust-module", "--out", str(tmp_path / "by-module")]) == 1
    err = capsys.readouterr().err
    assert "validating against the saved" in err and "MisnamedHeads itself (--trust-module)" in err
    manifest = json.loads((tmp_path / "by-module" / "manifest.json").read_text())
    assert manifest["valid"] is False and manifest["source"]["validated_against"] == "the saved module"

    torch.save(DocSelfAttention(D, 8), tmp_path / "true.pt")
    assert cli(["export", "--weights", str(tmp_path / "true.pt"), "--trust-module", "--out", str(tmp_path / "t")]) == 0
    torch.save(DocSelfAttention(D, 8).state_dict(), tmp_path / "state.pt")
    refused = cli(["export", "--weights", str(tmp_path / "state.pt"), "--heads", "8", "--trust-module"])
    assert refused == 2 and "holds tensors, not a whole saved module" in capsys.readouterr().err
