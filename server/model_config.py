"""A model's own configuration: ``config.pbtxt`` in its folder, read as Triton reads it (protobuf text format of
Triton's ModelConfig), so that one model batches, queues and runs as it needs while the server's flags stay the
defaults for every model that says nothing, and the ceilings for what it may ask.

Where it is: ``REPOSITORY/NAME/config.pbtxt`` beside the version folders, as in a Triton repository; with
``--model-dir DIR``, ``DIR/config.pbtxt``. Read at each version's load, so a new version takes the file as it is
then. Triton's fields where they mean the same here:

    max_batch_size: 8                                    the batch cap (rows a request and a run may hold)
    dynamic_batching { max_queue_delay_microseconds: 500
                       default_queue_policy { max_queue_size: 64 default_timeout_microseconds: 100000
                                              allow_timeout_override: true }     (timeout_action REJECT only)
                       priority_levels: 2 default_priority_level: 2
                       priority_queue_policy { key: 2 value { max_queue_size: 8 } } }
    instance_group [ { count: 2 } ]                      model runs at once (the inference workers it uses)
    sequence_batching { max_sequence_idle_microseconds: 60000000 }   (in place of dynamic_batching, as in Triton)
    version_policy { all { } }                           which versions serve (latest { num_versions: 2 },
                                                         specific { versions: [1, 3] }); read by the registry

and mhaserve's own settings, named as the server's flags, in ``parameters`` (the limits ``max_q_len`` and
``max_kv_len`` among them):

    parameters { key: "dynamic_batching" value { string_value: "false" } }

Anything else Triton's format holds (inputs, outputs, platform: the model's own folder says those; fields this
server has no use for, such as optimization or model_warmup) is read past.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass, fields, replace
from pathlib import Path

from google.protobuf import json_format, text_format

from mhaserve.contract.model_dir import ModelDirError
from mhaserve.contract.repository import MODEL_CONFIG_FILE as CONFIG_FILE
from mhaserve.contract.repository import VersionPolicy
from mhaserve.protos.generated import model_config_pb2 as mc

from .config import (
    SETTING_FIELDS,
    ServerSettings,
    flag_of,
    priority_problem,
    reader_of,
    setting_text,
)
from .tensors import Limits

log = logging.getLogger("mhaserve.server")

# What export's Triton repository writes to describe the model: read past, not settings.
DESCRIPTIVE_PARAMETERS = frozenset({"precision", "computes_in", "d_model", "num_heads", "provider"})


class ModelConfigError(ModelDirError):
    """A model's config.pbtxt that cannot be served as written: the version is not loaded, and says why."""


@dataclass(frozen=True)
class ModelSettings:
    """How one model is served: the server's settings, overridden where its config.pbtxt says otherwise."""

    max_batch_size: int
    dynamic_batching: bool
    max_queue_delay_us: int
    max_queue_size: int
    queue_timeout_us: int
    allow_timeout_override: bool
    priority_levels: int
    default_priority_level: int
    priority_queue_policy: str
    inference_workers: int
    intra_op_threads: int
    intra_op_spin_ms: float
    length_aware_batching: bool
    output_only_graph: bool
    summaries_graph: bool
    parity_share: float
    max_q_len: int
    max_kv_len: int
    max_sequence_length: int
    sequence_idle_timeout_s: float
    version_policy: str
    source: Path | str | None = None  # the config.pbtxt it was read from (or LOAD_REQUEST); None: the flags alone
    configured: frozenset[str] = frozenset()  # the settings that file sets; the others are the server's

    @classmethod
    def of_server(cls, settings: ServerSettings) -> ModelSettings:
        return cls(**{name: getattr(settings, name) for name in PARAMETERS})

    def as_text(self) -> dict[str, str]:
        return {name: setting_text(getattr(self, name)) for name in PARAMETERS}

    def named(self, name: str) -> str:
        """Where a setting comes from, for a refusal to name: this file, or the server's flag."""
        return f"{name} ({self.source})" if name in self.configured else flag_of(name)

    def limits(self) -> Limits:
        """What one request to this model may carry, naming this file where it set a limit."""
        names = ("max_batch_size", "max_q_len", "max_kv_len")
        configured = tuple(name for name in names if name in self.configured)
        return Limits(*(getattr(self, name) for name in names), str(self.source or ""), configured)


# Settings a model may ask no more of than the server was started with: its memory estimates, its message limits
# and its inference workers are the process's.
CEILINGS = ("max_batch_size", "inference_workers", "max_q_len", "max_kv_len")
PARAMETERS = tuple(f.name for f in fields(ModelSettings) if f.name not in ("source", "configured"))


# Where the settings of a model loaded with a configuration of its own come from (Triton's load "config").
LOAD_REQUEST = "the load request's config"


def model_settings(
    settings: ServerSettings,
    folder: Path,
    name: str | None = None,
    *,
    quiet: bool = False,
    config_json: str | None = None,
) -> ModelSettings:
    """``folder``'s config.pbtxt over the server's settings; the server's alone where there is none. Raises
    ModelConfigError naming the file and the field for a file that cannot be served as written, or one naming
    a model other than ``name`` (the model served from it). ``quiet``: what it reads past is not logged.
    ``config_json``: a configuration given with the model's load, as Triton's JSON, read in place of the file."""
    level = logging.DEBUG if quiet else logging.WARNING  # of the lines saying what is read past
    path: Path | str = folder / CONFIG_FILE
    server = ModelSettings.of_server(settings)
    if config_json is not None:
        path = LOAD_REQUEST
        config = _parsed_json(config_json, level)
    elif not path.is_file():
        return server
    else:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise ModelConfigError(f"{path}: not a model configuration in Triton's text format ({error})") from None
        config = config_of_text(text, path, level)
    if name is not None and config.name and config.name != name:
        raise ModelConfigError(
            f"{path}: name {config.name!r} is not the model it configures, {name!r} (as in Triton, a repository's "
            "model is named by its folder); write that name or leave the field out"
        )
    asked: dict[str, object] = {}
    if config.max_batch_size:
        asked["max_batch_size"] = config.max_batch_size
    if config.HasField("dynamic_batching"):
        batching = config.dynamic_batching
        asked["dynamic_batching"] = True
        asked["max_queue_delay_us"] = batching.max_queue_delay_microseconds
        policy = batching.default_queue_policy
        if policy.max_queue_size:
            asked["max_queue_size"] = policy.max_queue_size
        if policy.default_timeout_microseconds:
            asked["queue_timeout_us"] = policy.default_timeout_microseconds
        if policy.allow_timeout_override:
            asked["allow_timeout_override"] = True
        if batching.priority_queue_policy:
            asked["priority_queue_policy"] = _level_policies_text(batching.priority_queue_policy)
        for each in (policy, *batching.priority_queue_policy.values()):
            if each.timeout_action == mc.ModelQueuePolicy.DELAY:
                raise ModelConfigError(f"{path}: timeout_action DELAY is not supported: a request past its queue "
                                       "timeout is refused (REJECT)")  # fmt: skip
        for name in ("priority_levels", "default_priority_level"):
            if getattr(batching, name):
                asked[name] = getattr(batching, name)
        if batching.preferred_batch_size:  # Triton's, honoured by no setting here: said rather than read past
            log.log(level, "%s: dynamic_batching's preferred_batch_size is read past: a free worker takes what is "
                           "queued, up to max_batch_size rows a run", path)  # fmt: skip
    if config.HasField("sequence_batching") and config.sequence_batching.max_sequence_idle_microseconds:
        asked["sequence_idle_timeout_s"] = config.sequence_batching.max_sequence_idle_microseconds / 1e6
    if config.HasField("version_policy"):
        asked["version_policy"] = _policy_text(config.version_policy)
    if config.instance_group:
        asked["inference_workers"] = sum(group.count or 1 for group in config.instance_group)
    for key, parameter in config.parameters.items():
        if key in DESCRIPTIVE_PARAMETERS:
            continue
        if key not in PARAMETERS:
            raise ModelConfigError(
                f"{path}: parameter '{key}' is not a setting a model may set; expected one of {', '.join(PARAMETERS)}"
            )
        try:
            asked[key] = reader_of(SETTING_FIELDS[key])(parameter.string_value)
        except (ValueError, argparse.ArgumentTypeError) as error:
            raise ModelConfigError(f"{path}: parameter '{key}': {error}") from None
    for key, value in asked.items():
        rule = SETTING_FIELDS[key].metadata["rule"]
        if rule is not None and not rule.holds(value):
            raise ModelConfigError(f"{path}: {key} {replace(rule, show_value=True).refusal(value)}")
        if key in CEILINGS and value > getattr(settings, key):
            raise ModelConfigError(
                f"{path}: {key} {value} is above the server's {flag_of(key)} {getattr(settings, key)}, the most any "
                "model may ask for (the server's memory estimates, message limits and inference workers are sized "
                "by it)"
            )
    served = replace(server, **asked, source=path, configured=frozenset(asked))
    problem = priority_problem(served.priority_levels, served.default_priority_level, served.priority_queue_policy)
    if problem is not None:
        setting, said = problem
        raise ModelConfigError(f"{path}: {served.named(setting)} {said}")
    return served


def _level_policies_text(policies) -> str:
    """Triton's priority_queue_policy map as --priority-queue-policy writes it."""
    return ";".join(
        f"{level}:max_queue_size={p.max_queue_size},default_timeout_microseconds={p.default_timeout_microseconds},"
        f"allow_timeout_override={setting_text(p.allow_timeout_override)}"
        for level, p in sorted(policies.items())
    )


def _policy_text(policy: mc.ModelVersionPolicy) -> str:
    """Triton's version_policy as --version-policy writes it; none chosen is Triton's default, the newest one."""
    choice = policy.WhichOneof("policy_choice")
    if choice == "all":
        return "all"
    if choice == "specific":
        return "specific:" + ",".join(map(str, policy.specific.versions))
    return f"latest:{policy.latest.num_versions if choice == 'latest' else 1}"


def policy_message(text: str) -> mc.ModelVersionPolicy:
    """A --version-policy as Triton's version_policy message (what config.pbtxt and the ModelConfig RPC say)."""
    policy = VersionPolicy.parse(text)
    message = mc.ModelVersionPolicy()
    if policy.kind == "all":
        message.all.SetInParent()
    elif policy.kind == "specific":
        message.specific.versions.extend(policy.versions)
    else:
        message.latest.num_versions = policy.count
    return message


def _parsed_json(text: str, level: int) -> mc.ModelConfig:
    """A load request's configuration, Triton's ModelConfig as JSON; fields it has no use for read past, as the
    file's are."""
    try:
        given = json.loads(text)
        if not isinstance(given, dict):
            raise ValueError(f"expected a JSON object, got a {type(given).__name__}")
        config = json_format.ParseDict(given, mc.ModelConfig(), ignore_unknown_fields=True)
    except (ValueError, json_format.ParseError) as error:
        raise ModelConfigError(f"{LOAD_REQUEST}: not a model configuration in Triton's JSON ({error})") from None
    except RecursionError:
        raise ModelConfigError(f"{LOAD_REQUEST}: nested deeper than a model configuration is") from None
    known = {name for f in mc.ModelConfig.DESCRIPTOR.fields for name in (f.name, f.json_name)}
    unread = sorted(set(given) - known)
    if unread:
        log.log(level, "%s: fields mhaserve does not read are read past: %s", LOAD_REQUEST, ", ".join(unread))
    return config


def config_of_text(text: str, path: Path | str, level: int = logging.DEBUG) -> mc.ModelConfig:
    """A model configuration in Triton's text format (``path``'s, as config.pbtxt is), the fields mhaserve has no
    use for read past and named in one log line at ``level``. Raises ModelConfigError naming ``path``."""
    try:
        return _parsed(text, path, level)
    except text_format.ParseError as error:
        raise ModelConfigError(f"{path}: not a model configuration in Triton's text format ({error})") from None
    except RecursionError:
        raise ModelConfigError(f"{path}: nested deeper than a model configuration is") from None


def _parsed(text: str, path: Path | str, level: int) -> mc.ModelConfig:
    """Triton's fields mhaserve has no use for (optimization, model_warmup, ...) are read past, so that a Triton
    repository's file serves as it is; said once in the log, each named, since a misspelt field reads the same."""
    try:
        return text_format.Parse(text, mc.ModelConfig())
    except text_format.ParseError as error:
        if "has no field named" not in str(error):
            raise
        first = error
    config = _parsed_past_unknown_fields(text)
    if log.isEnabledFor(level):  # the walk over its tokens only for a line that is written
        said = ", ".join(_unread_fields(text)) or f"the first: {first}"
        log.log(level, "%s: fields mhaserve does not read are read past: %s", path, said)
    return config


def _parsed_past_unknown_fields(text: str) -> mc.ModelConfig:
    for _ in range(text.count("[")):
        try:
            return text_format.Parse(text, mc.ModelConfig(), allow_unknown_field=True)
        except text_format.ParseError as error:
            # protobuf skips an unknown field's list (Triton's `model_warmup [ { ... } ]`) only after a colon,
            # which the format lets a message field's list leave out: written in, the file means the same.
            lines = text.split("\n")
            line, column = error.GetLine() - 1, error.GetColumn() - 1
            if not (0 <= line < len(lines) and lines[line][column : column + 1] == "["):
                raise
            lines[line] = lines[line][:column] + ":" + lines[line][column:]
            text = "\n".join(lines)
    return text_format.Parse(text, mc.ModelConfig(), allow_unknown_field=True)


OPENING, CLOSING = ("{", "<", "["), ("}", ">", "]")


def _unread_fields(text: str) -> list[str]:
    """The fields of a file protobuf has parsed that ModelConfig does not have, as paths in the order they come
    (model_warmup, instance_group.rate_limiter): its tokens walked against ModelConfig's fields. Empty where the
    walk does not follow the file (a form it does not know)."""
    tokenizer = text_format.Tokenizer(text.splitlines())
    tokens = []
    while not tokenizer.AtEnd():
        tokens.append(tokenizer.token)
        tokenizer.NextToken()
    unread: list[str] = []

    def past_value(i: int) -> int:
        """The index past the value at ``i``: a message or list, bracketed, or one scalar (a sign apart)."""
        if tokens[i] not in OPENING:
            return i + (2 if tokens[i] == "-" else 1)
        depth = 0
        while True:
            depth += (tokens[i] in OPENING) - (tokens[i] in CLOSING)
            i += 1
            if depth == 0:
                return i

    def walk(i: int, descriptor, path: str) -> int:
        """The fields of one message from ``i`` to its closing token (or the end): the index of that token."""
        while i < len(tokens) and tokens[i] not in CLOSING:
            name, i = tokens[i], i + 1
            if name in (",", ";"):
                continue
            field = descriptor.fields_by_name.get(name)
            i += tokens[i] == ":"
            if field is None or field.message_type is None:
                if field is None and path + name not in unread:
                    unread.append(path + name)
                i = past_value(i)
            elif tokens[i] == "[":  # a list of messages
                i += 1
                while tokens[i] != "]":
                    i = i + 1 if tokens[i] == "," else walk(i + 1, field.message_type, f"{path}{name}.") + 1
                i += 1
            else:
                i = walk(i + 1, field.message_type, f"{path}{name}.") + 1
        return i

    try:
        walk(0, mc.ModelConfig.DESCRIPTOR, "")
    except (IndexError, text_format.ParseError):
        return []
    return unread


def config_text(name: str, values: dict[str, object]) -> str:
    """A config.pbtxt that sets ``values`` (settings named as the server's flags), in Triton's fields where they
    mean the same and mhaserve's parameters otherwise."""
    config = mc.ModelConfig(name=name)
    rest = dict(values)
    if "max_batch_size" in rest:
        config.max_batch_size = rest.pop("max_batch_size")
    if rest.get("dynamic_batching", None) is not False and "max_queue_delay_us" in rest:
        config.dynamic_batching.max_queue_delay_microseconds = rest.pop("max_queue_delay_us")
        rest.pop("dynamic_batching", None)
    if "inference_workers" in rest:
        config.instance_group.add(count=rest.pop("inference_workers"))
    if "version_policy" in rest:
        config.version_policy.CopyFrom(policy_message(rest.pop("version_policy")))
    for key, value in rest.items():
        config.parameters[key].string_value = setting_text(value)
    return text_format.MessageToString(config)


def config_template(name: str, description: dict[str, object], settings: ServerSettings | None = None) -> str:
    """The config.pbtxt export writes beside a model: its name and what it is, then every setting a model may set
    at the server's default, commented out, so that the server's flags apply until a line is uncommented."""
    defaults = ModelSettings.of_server(settings or ServerSettings())
    lines = [
        f"# How the server serves model {name!r}, read at each load (Triton's config.pbtxt format and fields).",
        "# The settings below are commented out: the server's flags apply. Uncomment one to set it for this model",
        f"# alone; {', '.join(CEILINGS)} may ask no more than the server's flags.",
        f"name: {json.dumps(name)}",
        *(_parameter(key, value) for key, value in description.items()),
    ]
    for key in PARAMETERS:
        value = getattr(defaults, key)
        if key == "max_queue_delay_us":  # one block in Triton's fields: its delay is 0 where it says none
            lines.append(f"# dynamic_batching {{ max_queue_delay_microseconds: {value} "
                         f"default_queue_policy {{ max_queue_size: {defaults.max_queue_size} }} }}")  # fmt: skip
        elif key != "max_queue_size":
            lines.append("# " + _setting_line(key, value))
    return "\n".join(lines) + "\n"


def _parameter(key: str, value) -> str:
    return f"parameters {{ key: {json.dumps(key)} value {{ string_value: {json.dumps(setting_text(value))} }} }}"


def _setting_line(key: str, value) -> str:
    """One setting as config.pbtxt says it: Triton's field where it means the same, else a parameter."""
    triton = {
        "max_batch_size": "max_batch_size: {}",
        "inference_workers": "instance_group [ {{ count: {} }} ]",
        "sequence_idle_timeout_s": "sequence_batching {{ max_sequence_idle_microseconds: {} }}",
    }
    if key == "sequence_idle_timeout_s":
        value = round(value * 1e6)
    if key == "version_policy":
        return f"version_policy {{ {text_format.MessageToString(policy_message(value), as_one_line=True)} }}"
    return triton[key].format(value) if key in triton else _parameter(key, value)
