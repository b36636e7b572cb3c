"""A trained attention layer from the weights users save, into the served module.

Layouts read, each under any key prefix (``module.``, ``encoder.layers.3.self_attn.``, ...):

- the design documents' modules: ``W_q, W_k, W_v, W_o`` or ``w_q, w_k, w_v, w_o`` (``.weight``, ``.bias``);
- ``nn.MultiheadAttention``: ``in_proj_weight``/``in_proj_bias`` (W_q, W_k, W_v stacked) and ``out_proj.*``;
- BERT-style encoders: ``attention.self.{query,key,value}`` and ``attention.output.dense``; ViT's
  ``attention.attention.{query,key,value}``; DistilBERT's ``q_lin, k_lin, v_lin, out_lin``;
- BART-style attention (BART, Marian, OPT, Whisper): ``q_proj, k_proj, v_proj, out_proj``;
- GPT-2: ``c_attn`` (W_q, W_k, W_v side by side, stored input by output as its Conv1D keeps them) and ``c_proj``;
- mhaserve's own weights files (``save_weights``: the state dict with ``d_model`` and ``num_heads``).

A projection without a bias (``bias=False``, or Whisper's key projection) is served with a zero bias, the same
computation.

Files: ``.safetensors`` (the safetensors package) or anything else torch.load reads with
``weights_only=True`` (``.pt``, ``.pth``, ``.bin``); or a folder as Hugging Face's ``save_pretrained`` writes it
(``model.safetensors`` or ``pytorch_model.bin``, or shards and their ``.index.json``, of which only those holding
the layer are read). Nested dicts (``{"state_dict": ...}``,
``{"model": ...}``) are read as dotted prefixes. A whole module saved with ``torch.save(model)`` is read
without running any of its code (SavedModuleReader): its tensors, and its attention layer's head count
from the layer's own attributes. Every shape is checked before a module is built, and every refusal is a
CheckpointError of one line naming the key and the shapes found.

The head count is not in a bare state dict's shapes: it is read where the weights say it (mhaserve's own
files, a safetensors file's ``num_heads`` metadata, a saved module's attributes, a ``config.json`` beside
the file as Hugging Face writes it), and a ``--heads`` that contradicts any of them is refused.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mhaserve.contract.errors import UsageError
from mhaserve.contract.model_dir import file_sha256

from .mha import MultiHeadAttention


class CheckpointError(UsageError):
    """A weights file or state dict that holds no servable attention layer, or not only one."""


@dataclass(frozen=True)
class Layout:
    """How one attention layer's four projections are named in a state dict."""

    name: str
    query: str  # the key (after the prefix) that marks a layer of this layout
    names: tuple[str, str, str, str] | None  # W_q, W_k, W_v, W_o modules; None: packed (below)
    # W_q, W_k, W_v in one tensor and W_o: their modules, and whether stored input by output (a Conv1D's)
    packed: tuple[str, str, bool] | None = None


LAYOUTS = (
    Layout("W_q..W_o", "W_q.weight", ("W_q", "W_k", "W_v", "W_o")),
    Layout("w_q..w_o", "w_q.weight", ("w_q", "w_k", "w_v", "w_o")),
    Layout("nn.MultiheadAttention", "in_proj_weight", None, ("in_proj_", "out_proj.", False)),
    Layout(
        "BERT",
        "attention.self.query.weight",
        ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"),
    ),
    Layout(
        "ViT",
        "attention.attention.query.weight",
        ("attention.attention.query", "attention.attention.key", "attention.attention.value", "attention.output.dense"),
    ),
    Layout("DistilBERT", "q_lin.weight", ("q_lin", "k_lin", "v_lin", "out_lin")),
    Layout("q_proj..out_proj", "q_proj.weight", ("q_proj", "k_proj", "v_proj", "out_proj")),
    Layout("GPT-2", "c_attn.weight", None, ("c_attn.", "c_proj.", True)),
)
MHASERVE_LAYOUT = "mhaserve"


@dataclass(frozen=True)
class AttentionLayer:
    """One attention layer found in a state dict."""

    layout: Layout
    prefix: str


# Where modules keep their head count: the design documents' (h, num_heads), nn.MultiheadAttention's (num_heads),
# Hugging Face's (num_attention_heads, n_head, ...).
HEADS_ATTRIBUTES = ("num_heads", "n_heads", "h", "heads", "nhead", "n_head", "num_attention_heads")
# What a config.json beside the weights may call it (Hugging Face's configs), and d_model.
CONFIG_HEADS_KEYS = ("num_attention_heads", "num_heads", "n_head", "n_heads", "nhead", "encoder_attention_heads")
CONFIG_D_MODEL_KEYS = ("hidden_size", "d_model", "n_embd", "embed_dim", "dim")


def declared_heads(module) -> int | None:
    """The head count a module keeps in its first attribute of HEADS_ATTRIBUTES that holds an integer, if any."""
    return next((value for a in HEADS_ATTRIBUTES if type(value := getattr(module, a, None)) is int), None)


@dataclass(frozen=True)
class Checkpoint:
    """A weights file as read: its flat state dict, and what the file says beside the tensors."""

    state: dict[str, torch.Tensor]
    num_heads: int | None  # when the file carries it (mhaserve's own files, safetensors metadata)
    mhaserve_format: bool
    # a saved module's head counts by module path ("" the module itself, "layers.0.self_attn." one inside it)
    module_heads: dict[str, int] | None = None
    module_class: str | None = None  # a saved module's class, as the file names it
    files: list[Path] = field(default_factory=list)  # the files read (a folder's shards as their tensors are read)

    def heads_of(self, layer: AttentionLayer) -> int | None:
        """The head count the file gives ``layer``: the file's own, or the attribute of the innermost module on the
        path from the layer's prefix to its query projection that has one."""
        if self.num_heads is not None or not self.module_heads:
            return self.num_heads
        path, found = layer.prefix, self.module_heads.get(layer.prefix)
        for part in layer.layout.query.split(".")[:-2]:  # the modules between the prefix and the projection
            path += part + "."
            found = self.module_heads.get(path, found)
        return found


def find_layers(state: Mapping[str, torch.Tensor]) -> list[AttentionLayer]:
    """Every attention layer whose marking key is in ``state``, in key order."""
    found = []
    for key in state:
        for layout in LAYOUTS:
            if key.endswith(layout.query):
                prefix = key[: -len(layout.query)]
                if prefix == "" or prefix.endswith("."):
                    found.append(AttentionLayer(layout, prefix))
    return found


def pick_layer(state: Mapping[str, torch.Tensor], prefix: str | None, where: str) -> AttentionLayer:
    """The one layer at ``prefix`` (any, when there is only one); refuses none, or several without a prefix."""
    layers = find_layers(state)
    if prefix is not None:
        prefix = prefix if prefix == "" or prefix.endswith(".") else prefix + "."
        chosen = [layer for layer in layers if layer.prefix == prefix]
        if not chosen:
            found = ", ".join(repr(layer.prefix) for layer in layers) or "none"
            raise CheckpointError(f"{where}: no attention layer at prefix {prefix!r}; prefixes found: {found}")
        layers = chosen
    if not layers:
        _refuse_unservable_multihead_attention(state, where)
        keys = list(state)
        sample = ", ".join(keys[:6]) + (f", ... ({len(keys)} keys)" if len(keys) > 6 else "")
        known = "; ".join(f"{layout.name} ({layout.query})" for layout in LAYOUTS)
        raise CheckpointError(f"{where}: no known attention layout among its keys [{sample}]; known: {known}")
    if len(layers) > 1:
        prefixes = ", ".join(f"{layer.prefix!r} ({layer.layout.name})" for layer in layers)
        raise CheckpointError(f"{where} holds {len(layers)} attention layers; pick one with --prefix: {prefixes}")
    return layers[0]


def _tensor(state: Mapping, key: str, where: str, what: str) -> torch.Tensor:
    value = state.get(key)
    if value is None:
        raise CheckpointError(f"{where}: {what} '{key}' is missing")
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        kind = f"{value.dtype} tensor" if isinstance(value, torch.Tensor) else type(value).__name__
        raise CheckpointError(f"{where}: '{key}' is a {kind}, expected a floating-point tensor")
    finite = torch.isfinite(value)
    if not bool(finite.all()):
        at = tuple(int(i) for i in (~finite).nonzero()[0])
        raise CheckpointError(
            f"{where}: '{key}' holds {value[at].item()} at {list(at)} ({int((~finite).sum())} of {value.numel()} "
            "values not finite): these weights answer nothing (did the training diverge?)"
        )
    return value


def _shape(tensor: torch.Tensor) -> str:
    return "[" + ", ".join(str(d) for d in tensor.shape) + "]"


def _refuse_unservable_multihead_attention(keys, where: str) -> None:
    """nn.MultiheadAttention's forms the served module has no equivalent of, refused by the keys they add."""
    for key in keys:
        if key.endswith(("q_proj_weight", "bias_k")):
            raise CheckpointError(
                f"{where}: '{key}' is set: nn.MultiheadAttention with kdim/vdim != embed_dim or add_bias_kv=True "
                "has no equivalent in the served module"
            )


def projections(state: Mapping, layer: AttentionLayer, where: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The layer's W_q..W_o weights and biases as a state dict of the served module, every shape checked, and the
    keys of the biases the file does not hold (a projection without one: served with zeros)."""
    p = layer.prefix
    absent: list[str] = []

    def bias(key: str, size: int) -> torch.Tensor:
        if key not in state:
            absent.append(key)
            return torch.zeros(size)
        return _tensor(state, key, where, "bias")

    if layer.layout.packed is not None:  # q, k, v in one tensor, along its output dim
        _refuse_unservable_multihead_attention([k for k in (p + "q_proj_weight", p + "bias_k") if k in state], where)
        qkv, out, conv1d = layer.layout.packed
        packed_key = p + qkv + "weight"
        stored = _tensor(state, packed_key, where, "weight")
        packed_w = stored.T if conv1d and stored.dim() == 2 else stored  # a Conv1D's: stored input by output
        if packed_w.dim() != 2 or packed_w.shape[0] != 3 * packed_w.shape[1]:
            expected = "[d_model, 3 * d_model]" if conv1d else "[3 * d_model, d_model]"
            raise CheckpointError(f"{where}: '{packed_key}' has shape {_shape(stored)}, expected {expected}")
        d = packed_w.shape[1]
        packed_b = bias(p + qkv + "bias", 3 * d)
        if tuple(packed_b.shape) != (3 * d,):
            raise CheckpointError(f"{where}: '{p + qkv}bias' has shape {_shape(packed_b)}, expected [{3 * d}]")
        out_w = _tensor(state, p + out + "weight", where, "weight")
        pairs = [*zip(packed_w.split(d), packed_b.split(d), strict=True), (out_w.T if conv1d else out_w, p + out)]
        keys = [packed_key] * 3 + [p + out + "weight"]
    else:
        keys = [p + name + ".weight" for name in layer.layout.names]
        pairs = [(_tensor(state, key, where, "weight"), key[: -len("weight")]) for key in keys]
    first_weight, first_key = pairs[0][0], keys[0]
    d = first_weight.shape[-1]
    served = {}
    for name, key, (weight, weight_bias) in zip(("W_q", "W_k", "W_v", "W_o"), keys, pairs, strict=True):
        if weight.dim() != 2 or weight.shape[0] != weight.shape[1]:
            grouped = ""
            if name in ("W_k", "W_v") and weight.dim() == 2 and weight.shape[1] == d and d % weight.shape[0] == 0:
                grouped = " (fewer key/value heads than query heads, grouped-query attention, is not served)"
            raise CheckpointError(
                f"{where}: '{key}' has shape {_shape(weight)}, expected a square [d_model, d_model] projection{grouped}"
            )
        if weight.shape[0] != d:
            raise CheckpointError(
                f"{where}: '{key}' has shape {_shape(weight)} while '{first_key}' has {_shape(first_weight)}; "
                "the four projections must have one d_model"
            )
        if isinstance(weight_bias, str):  # the module's prefix: its bias, if it has one
            weight_bias = bias(weight_bias + "bias", d)
        if tuple(weight_bias.shape) != (d,):
            raise CheckpointError(f"{where}: the bias of '{key}' has shape {_shape(weight_bias)}, expected [{d}]")
        served[f"{name}.weight"], served[f"{name}.bias"] = weight, weight_bias
    return served, absent


def module_from_state_dict(
    state: Mapping[str, torch.Tensor], num_heads: int | None, prefix: str | None = None, where: str = "state dict"
) -> tuple[MultiHeadAttention, AttentionLayer]:
    """The served module holding the weights of the one attention layer in ``state`` (or the one at ``prefix``)."""
    layer = pick_layer(state, prefix, where)
    served, _ = projections(state, layer, where)
    return _module_of(served, num_heads, state, layer, where), layer


def _module_of(
    served: dict[str, torch.Tensor], num_heads: int | None, state: Mapping, layer: AttentionLayer, where: str
) -> MultiHeadAttention:
    """The served module holding ``served`` (the layer's projections, as ``projections`` gives them)."""
    d_model = served["W_q.weight"].shape[0]
    marker = layer.prefix + layer.layout.query
    if num_heads is None:
        raise CheckpointError(
            f"{where}: the number of heads is not in the file (a state dict's shapes do not say it); give your "
            "module's with --heads, or keep a config.json naming num_attention_heads beside the file"
        )
    if num_heads <= 0 or d_model % num_heads:
        raise CheckpointError(
            f"{where}: d_model {d_model} (from '{marker}' {_shape(state[marker])}) is not "
            f"divisible by {num_heads} heads"
        )
    with torch.device("meta"):  # no weights drawn only to be overwritten: the shapes are known to fit
        module = MultiHeadAttention(d_model, num_heads)
    module.load_state_dict({k: v.detach().to(torch.float32) for k, v in served.items()}, assign=True)
    return module.eval()


def _check_answers(module: MultiHeadAttention, where: str) -> None:
    """Refuses weights whose own module answers inf or NaN at unit-scale inputs (weights so large that float32
    overflows): there is no answer to export or validate against."""
    inputs = torch.randn(1, 4, module.d_model, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        output, weights = module(inputs, inputs, inputs)
        if torch.isfinite(output).all() and torch.isfinite(weights).all():
            return
        largest = max(float(p.abs().max()) for p in module.parameters())
        raise CheckpointError(
            f"{where}: the module these weights make answers inf or NaN for unit-scale inputs (its largest weight "
            f"is {largest:.3g}: float32 overflows): nothing to export"
        )


# What Hugging Face's save_pretrained writes into a folder, in the order it prefers them; sharded, each with an
# index (NAME.index.json) mapping every tensor to its shard.
PRETRAINED_FILES = ("model.safetensors", "pytorch_model.bin")


def read_checkpoint(path: str | Path) -> Checkpoint:
    """The flat state dict of a .safetensors file or a torch.save file (loaded with weights_only=True), or of a
    folder save_pretrained wrote."""
    path = Path(path)
    if path.is_dir():
        return _read_folder(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    checkpoint = _read_file(path)
    checkpoint.files.append(path)
    return checkpoint


def _read_folder(folder: Path) -> Checkpoint:
    for name in PRETRAINED_FILES:
        if (folder / name).is_file():
            return read_checkpoint(folder / name)
    for name in PRETRAINED_FILES:
        index = folder / f"{name}.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as error:
                raise CheckpointError(f"{index}: not an index of shards ({type(error).__name__}: {error})") from None
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: 'weight_map' is not an object naming each tensor's shard")
            files: list[Path] = []
            return Checkpoint(_ShardedState(folder, weight_map, files), None, False, files=files)
    found = sorted(p.name for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth"))
    if len(found) == 1:
        return read_checkpoint(folder / found[0])
    held = f"; it holds {', '.join(found)}: give one of them" if found else ""
    raise CheckpointError(f"{folder}: a folder without {' or '.join(PRETRAINED_FILES)} or an index of shards{held}")


class _ShardedState(Mapping):
    """Sharded weights' tensors by key, from their index; a shard is read when one of its tensors is first asked
    for (a layer's tensors are in one or two shards of many), and listed in ``files``."""

    def __init__(self, folder: Path, weight_map: dict[str, str], files: list[Path]):
        self._folder, self._map, self._files = folder, weight_map, files
        self._shards: dict[str, dict] = {}

    def __getitem__(self, key: str) -> torch.Tensor:
        shard = self._map[key]
        if shard not in self._shards:
            path = self._folder / shard
            if not path.is_file():
                raise CheckpointError(f"{self._folder}: the shard {shard!r} its index names for {key!r} is missing")
            self._shards[shard] = _read_file(path).state
            self._files.append(path)
        if key not in self._shards[shard]:
            raise CheckpointError(f"{self._folder / shard}: holds no {key!r}, which its index places there")
        return self._shards[shard][key]

    def __contains__(self, key) -> bool:
        return key in self._map

    def __iter__(self) -> Iterator[str]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._map)


def _read_file(path: Path) -> Checkpoint:
    if path.suffix == ".safetensors":
        return _read_safetensors(path)
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        globals_refused = [line for line in lines if line.startswith("WeightsUnpickler error: Unsupported global")]
        if globals_refused:  # a pickled object (a whole nn.Module, say): read it without running its code
            return SavedModuleReader.read(path)
        found = [line for line in lines if line.startswith("Unsupported") or "load key" in line]
        why = (found or lines or [""])[0]
        raise CheckpointError(f"{path}: not a readable PyTorch checkpoint (UnpicklingError: {why})") from None
    except Exception as error:  # torch.load raises many kinds for a truncated or foreign file
        first = (str(error).strip().splitlines() or [""])[0].split(". ")[0]
        raise CheckpointError(f"{path}: not a readable PyTorch checkpoint ({type(error).__name__}: {first})") from None
    if not isinstance(saved, Mapping):
        raise CheckpointError(f"{path}: holds a {type(saved).__name__}, expected a state dict (a dict of tensors)")
    mhaserve_format = {"d_model", "num_heads", "state_dict"} <= set(saved)
    num_heads = saved.get("num_heads") if mhaserve_format else None
    if num_heads is not None and not isinstance(num_heads, int):
        raise CheckpointError(f"{path}: 'num_heads' is {num_heads!r}, expected an integer")
    state = _flatten(saved["state_dict"] if mhaserve_format else saved)
    if mhaserve_format:
        d_model = saved["d_model"]
        found = state.get("W_q.weight")
        if not isinstance(d_model, int) or found is None or found.shape[-1] != d_model:
            shape = _shape(found) if isinstance(found, torch.Tensor) else "none"
            raise CheckpointError(f"{path}: 'd_model' is {d_model!r} but 'W_q.weight' has shape {shape}")
    return Checkpoint(state, num_heads, mhaserve_format)


class _Unrun:
    """An object of a class a pickle names, rebuilt without importing or running that class: its state is kept."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2:  # (dict state, slots state)
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.__dict__.update(state)


class SavedModuleReader(pickle.Unpickler):
    """Reads a whole saved module (``torch.save(model)``) without running any of its code: the globals torch.load
    allows with ``weights_only=True`` (tensors, containers) are themselves, every other class is an _Unrun that
    keeps its state. The module's parameters and buffers make the state dict; its attributes, the head counts."""

    _allowed: dict | None = None

    def find_class(self, module: str, name: str):
        if SavedModuleReader._allowed is None:
            from torch._weights_only_unpickler import _get_allowed_globals

            SavedModuleReader._allowed = _get_allowed_globals()
        found = SavedModuleReader._allowed.get(f"{module}.{name}")
        if found is not None:
            return found
        return type(name, (_Unrun,), {"__module__": module, "__qualname__": name})

    @classmethod
    def read(cls, path: Path) -> Checkpoint:
        pickle_module = type("pickle_module", (), {"Unpickler": cls, "load": pickle.load, "__name__": "pickle"})
        try:
            saved = torch.load(path, map_location="cpu", weights_only=False, pickle_module=pickle_module)
        except Exception as error:
            first = (str(error).strip().splitlines() or [""])[0].split(". ")[0]
            raise CheckpointError(f"{path}: not a readable saved module ({type(error).__name__}: {first})") from None
        state, heads = {}, {}
        _walk_module(saved, "", state, heads)
        if not state:
            raise CheckpointError(f"{path}: holds a {type(saved).__qualname__} with no tensors, expected a module")
        kind = type(saved)
        return Checkpoint(state, None, False, heads, f"{kind.__module__}.{kind.__qualname__}")


def _walk_module(saved, prefix: str, state: dict, heads: dict) -> None:
    """A saved object's tensors by dotted key, its modules' parameters and buffers as a state dict names them, and
    each module's head count (HEADS_ATTRIBUTES) by its path."""
    if isinstance(saved, torch.Tensor):
        state[prefix.removesuffix(".")] = saved
    elif isinstance(saved, Mapping):
        for key, value in saved.items():
            _walk_module(value, f"{prefix}{key}.", state, heads)
    elif isinstance(saved, _Unrun):
        if (found := declared_heads(saved)) is not None:
            heads[prefix] = found
        for held in ("_parameters", "_buffers", "_modules"):
            members = saved.__dict__.get(held)
            if isinstance(members, Mapping):
                for key, value in members.items():
                    if value is not None:
                        _walk_module(value, f"{prefix}{key}.", state, heads)


def load_saved_module(path: str | Path, prefix: str) -> torch.nn.Module:
    """The attention layer at ``prefix`` of a whole saved module, loaded as torch.load loads it without
    ``weights_only``: its classes imported and its pickled code run, so only for a file its user trusts
    (``mhaserve export --trust-module``). It is what the export is then validated against."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=False)
    except (ImportError, AttributeError) as error:  # the module's class is not importable here
        raise CheckpointError(
            f"{path}: its module's code cannot be loaded here ({type(error).__name__}: {error}); put the module's "
            "package on PYTHONPATH, or drop --trust-module"
        ) from None
    if not isinstance(saved, torch.nn.Module):
        raise CheckpointError(f"{path}: holds a {type(saved).__name__}, not a saved module (--trust-module)")
    try:
        return saved.get_submodule(prefix.removesuffix(".")).eval()
    except AttributeError:
        raise CheckpointError(f"{path}: no module at {prefix!r} to validate against") from None


def heads_from_config(weights: Path, d_model: int, prefix: str = "") -> tuple[int, Path] | None:
    """The head count a ``config.json`` beside ``weights`` (or in it, a folder) gives (Hugging Face's keys; an
    encoder-decoder's own for the decoder's layers, by the layer's ``prefix``), and the file; None without one or
    without such a key. A config whose size contradicts ``d_model`` is refused: it is not these weights'."""
    config = (weights if weights.is_dir() else weights.parent) / "config.json"
    if not config.is_file():
        return None
    try:
        fields = json.loads(config.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{config}: not readable JSON ({error})") from None
    if not isinstance(fields, dict):
        return None
    keys = CONFIG_HEADS_KEYS
    if "decoder" in prefix.split("."):
        keys = ("decoder_attention_heads", *keys)
    heads = next((fields[k] for k in keys if k in fields), None)
    if heads is None:
        return None
    size = next((fields[k] for k in CONFIG_D_MODEL_KEYS if k in fields), d_model)
    if type(heads) is not int or heads <= 0:
        raise CheckpointError(f"{config}: the number of heads is {heads!r}, expected a positive integer")
    if size != d_model:
        raise CheckpointError(
            f"{config}: says a model size of {size!r}, while {weights.name} holds d_model {d_model}: not this "
            "file's configuration (move it, or name the heads with --heads)"
        )
    return heads, config


def _read_safetensors(path: Path) -> Checkpoint:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            metadata = handle.metadata() or {}
            state = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 (not a dict)
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{path}: not a readable safetensors file ({error})") from None
    heads = metadata.get("num_heads")
    if heads is not None and not heads.isdigit():
        raise CheckpointError(f"{path}: metadata 'num_heads' is {heads!r}, expected an integer")
    return Checkpoint(state, int(heads) if heads is not None else None, mhaserve_format=False)


def _flatten(tree: Mapping, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _digest_of(digests) -> str:
    return hashlib.sha256("".join(digests).encode()).hexdigest()


def load_checkpoint(
    path: str | Path, num_heads: int | None = None, prefix: str | None = None
) -> tuple[MultiHeadAttention, dict]:
    """The served module from a weights file, and the source to record: path, layout, prefix, sha256, and where the
    head count came from (``heads_from``: "--heads" alone where nothing else says it).

    ``num_heads`` is needed unless the weights say it (the file, or a config.json beside it); given as well, they
    must agree.
    """
    path = Path(path)
    checkpoint = read_checkpoint(path)
    where = str(path)
    layer = pick_layer(checkpoint.state, prefix, where)
    said = []  # (heads, who says so)
    in_file = checkpoint.heads_of(layer)
    if in_file is not None:
        said.append((in_file, "the saved module" if checkpoint.module_class else "the file"))
    served, biases_absent = projections(checkpoint.state, layer, where)
    d_model = served["W_q.weight"].shape[0]
    config = heads_from_config(path, d_model, layer.prefix)
    if config is not None:
        said.append((config[0], str(config[1])))
    if num_heads is not None:
        said.append((num_heads, "--heads"))
    if len({heads for heads, _ in said}) > 1:
        disagreeing = ", ".join(f"{who} says {heads} heads" for heads, who in said)
        raise CheckpointError(
            f"{where}: {disagreeing}; a wrong count exports and validates but answers unlike the trained module"
        )
    heads, heads_from = said[0] if said else (None, None)
    module = _module_of(served, heads, checkpoint.state, layer, where)  # the projections read and checked once
    _check_answers(module, where)
    files = checkpoint.files  # every file the layer's tensors were read from
    source = {
        "kind": "checkpoint",
        "path": str(path),
        "format": "safetensors" if all(f.suffix == ".safetensors" for f in files) else "torch",
        "layout": MHASERVE_LAYOUT if checkpoint.mhaserve_format else layer.layout.name,
        "prefix": layer.prefix,
        "heads_from": heads_from,
        # the file's; of several shards, their digests' in the order read
        "sha256": file_sha256(files[0]) if len(files) == 1 else _digest_of(file_sha256(f) for f in files),
    }
    if path.is_dir():
        source["files"] = [f.name for f in files]
    if checkpoint.module_class:
        source["module_class"] = checkpoint.module_class
    if biases_absent:
        source["biases_absent"] = biases_absent
    return module, source
