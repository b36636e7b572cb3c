"""A model's config.pbtxt read alone: Triton's fields where they mean the same, mhaserve's settings as parameters,
the server's flags where the file says nothing, and the file a tune writes read back as what it chose."""

from __future__ import annotations

import pytest

from mhaserve.contract.errors import UsageError
from mhaserve.contract.repository import VersionPolicy
from mhaserve.server.config import LevelPolicy, ServerSettings, check_settings, level_policies
from mhaserve.server.model_config import (
    PARAMETERS,
    ModelConfigError,
    ModelSettings,
    config_template,
    config_text,
    model_settings,
)


def test_no_file_is_the_server_s_settings(tmp_path):
    settings = ServerSettings(max_batch_size=16, max_queue_delay_us=200)
    assert model_settings(settings, tmp_path) == ModelSettings.of_server(settings)
    assert model_settings(settings, tmp_path).source is None


def test_triton_s_fields_and_mhaserve_s_parameters_override_the_flags_and_nothing_else(tmp_path):
    (tmp_path / "config.pbtxt").write_text(
        'name: "mha" platform: "onnxruntime_onnx" max_batch_size: 8\n'
        'input [ { name: "query" data_type: TYPE_FP32 dims: [ -1, 512 ] } ]\n'
        "dynamic_batching { max_queue_delay_microseconds: 300 default_queue_policy { max_queue_size: 9 } }\n"
        "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
        'parameters { key: "output_only_graph" value { string_value: "false" } }\n'
        'parameters { key: "precision" value { string_value: "fp32" } }\n'  # export's description: read past
    )
    model = model_settings(ServerSettings(dynamic_batching=False, intra_op_threads=2), tmp_path)
    assert (model.max_batch_size, model.dynamic_batching, model.max_queue_delay_us, model.max_queue_size) == (
        8, True, 300, 9
    )  # fmt: skip
    assert (model.inference_workers, model.output_only_graph, model.intra_op_threads) == (1, False, 2)
    assert model.source == tmp_path / "config.pbtxt"


def test_export_s_own_triton_config_serves_as_it_is(tmp_path):
    from google.protobuf import text_format

    from mhaserve.export.triton_repo import triton_config

    (tmp_path / "config.pbtxt").write_text(text_format.MessageToString(triton_config("mha", 512, 8)))
    model = model_settings(ServerSettings(), tmp_path)
    assert (model.max_batch_size, model.dynamic_batching, model.max_queue_delay_us) == (32, True, 0)


def test_a_setting_a_model_may_not_ask_for_is_refused_naming_the_file(tmp_path):
    (tmp_path / "config.pbtxt").write_text('parameters { key: "max_inflight_bytes" value { string_value: "1" } }')
    with pytest.raises(ModelConfigError, match=r"config.pbtxt: parameter 'max_inflight_bytes' is not a setting"):
        model_settings(ServerSettings(), tmp_path)
    (tmp_path / "config.pbtxt").write_text('parameters { key: "max_queue_size" value { string_value: "0" } }')
    with pytest.raises(ModelConfigError, match="max_queue_size must be at least 1, got 0"):
        model_settings(ServerSettings(), tmp_path)


@pytest.mark.parametrize(
    "chosen",
    [
        {"max_batch_size": 4, "max_queue_delay_us": 1000},
        {"dynamic_batching": False, "intra_op_threads": 1},
        {"dynamic_batching": True, "inference_workers": 2, "length_aware_batching": False},
        {},
    ],
)
def test_a_written_config_reads_back_as_the_setting_it_was_written_from(tmp_path, chosen):
    settings = ServerSettings(inference_workers=2)
    (tmp_path / "config.pbtxt").write_text(config_text("mha", chosen))
    model = model_settings(settings, tmp_path)
    expected = {**ModelSettings.of_server(settings).as_text(), **{k: str(v).lower() for k, v in chosen.items()}}
    if chosen.get("max_queue_delay_us"):
        expected["dynamic_batching"] = "true"
    assert model.as_text() == expected


def test_triton_s_fields_this_server_has_no_use_for_are_read_past(tmp_path, caplog):
    (tmp_path / "config.pbtxt").write_text(
        'model_warmup [ { name: "zeros" batch_size: 1 } ]\nmax_batch_size: 8\n'
        "sequence_batching { max_sequence_idle_microseconds: 5000000 }\n"
    )
    assert model_settings(ServerSettings(), tmp_path).max_batch_size == 8
    assert f"{tmp_path / 'config.pbtxt'}: fields mhaserve does not read are read past: model_warmup\n" in caplog.text


def test_a_triton_config_with_lists_of_fields_read_past_serves_as_written_and_each_is_named(tmp_path, caplog):
    """Triton's documents write a list of messages without a colon (`model_warmup [ { ... } ]`), which protobuf
    cannot skip in a field it does not know: such a file was refused as not Triton's format."""
    (tmp_path / "config.pbtxt").write_text("""
        name: "mha"
        max_batch_size: 4
        instance_group [ { count: 2 kind: KIND_CPU rate_limiter { resources [ { name: "R1" count: 4 } ] } } ]
        sequence_batching {
          max_sequence_idle_microseconds: 5000000
          control_input [ { name: "START" control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ] } ]
        }
        model_warmup [
          { name: "zeros" batch_size: 1 inputs { key: "query" value { data_type: TYPE_FP32 dims: [ 4, 512 ]
            zero_data: true } } }
        ]
        version_policy: { specific: { versions: [2] } }
        parameters { key: "max_q_len" value { string_value: "64" } }
    """)
    model = model_settings(ServerSettings(inference_workers=2), tmp_path, "mha")
    assert (model.max_batch_size, model.inference_workers, model.max_q_len) == (4, 2, 64)
    assert (model.sequence_idle_timeout_s, model.version_policy) == (5.0, "specific:2")
    unread = "instance_group.rate_limiter, sequence_batching.control_input, model_warmup"
    assert f"fields mhaserve does not read are read past: {unread}\n" in caplog.text


@pytest.mark.parametrize(
    "written, policy",
    [
        ("version_policy { all { } }", "all"),
        ("version_policy { latest { num_versions: 2 } }", "latest:2"),
        ("version_policy { specific { versions: [3, 1] } }", "specific:1,3"),
        ("version_policy { }", "latest:1"),  # none chosen: Triton's default
        ('parameters { key: "version_policy" value { string_value: "all" } }', "all"),
    ],
)
def test_a_model_s_version_policy_is_read_from_triton_s_field_or_its_parameter(tmp_path, written, policy):
    (tmp_path / "config.pbtxt").write_text(written)
    model = model_settings(ServerSettings(version_policy="latest:1"), tmp_path)
    assert str(VersionPolicy.parse(model.version_policy)) == policy and "version_policy" in model.configured
    (tmp_path / "config.pbtxt").write_text(config_text("mha", {"version_policy": model.version_policy}))
    assert str(VersionPolicy.parse(model_settings(ServerSettings(), tmp_path).version_policy)) == policy


NO_VERSION_POLICIES = (
    "version_policy { latest { num_versions: 0 } }",
    "version_policy { specific { } }",
    "version_policy { specific { versions: -2 } }",
    'parameters { key: "version_policy" value { string_value: "newest" } }',
)


@pytest.mark.parametrize("written", NO_VERSION_POLICIES)
def test_a_version_policy_that_serves_nothing_is_refused_naming_the_file(tmp_path, written):
    (tmp_path / "config.pbtxt").write_text(written)
    with pytest.raises(ModelConfigError, match=r"config.pbtxt: version_policy must be latest, latest:N, all or "):
        model_settings(ServerSettings(), tmp_path)


def test_a_limit_the_model_sets_is_named_with_its_file_and_the_others_with_the_server_s_flag(tmp_path):
    import numpy as np

    from mhaserve.contract.signature import ModelSignature
    from mhaserve.server.errors import RequestError
    from mhaserve.server.tensors import checked_inputs

    (tmp_path / "config.pbtxt").write_text('max_batch_size: 2\nparameters { key: "max_kv_len" value '
                                           '{ string_value: "8" } }')  # fmt: skip
    settings = ServerSettings(max_batch_size=4, max_q_len=16, max_kv_len=16)
    limits = model_settings(settings, tmp_path).limits()
    assert (limits.max_batch_size, limits.max_q_len, limits.max_kv_len) == (2, 16, 8)
    signature = ModelSignature("mha", "1", 4, 2)

    def refusal(batch: int, q_len: int, kv_len: int) -> str:
        query = np.zeros((batch, q_len, 4), np.float32)
        key = np.zeros((batch, kv_len, 4), np.float32)
        with pytest.raises(RequestError) as refused:
            checked_inputs({"query": query, "key": key}, ("output",), signature, limits)
        return refused.value.message

    assert refusal(3, 1, 1).endswith(f"batch 3 exceeds the limit max_batch_size=2 (set by {tmp_path}/config.pbtxt)")
    assert refusal(1, 1, 9).endswith(f"kv_len 9 exceeds the limit max_kv_len=8 (set by {tmp_path}/config.pbtxt)")
    assert refusal(1, 17, 1).endswith("q_len 17 exceeds the limit max_q_len=16 (the server's --max-q-len raises it)")


def test_the_budget_provides_for_a_model_that_batches_or_pads_where_the_flags_did_not():
    from mhaserve.server.memory import MemoryBudget

    budget = MemoryBudget(1 << 30, workers=1, max_batch_size=None)  # the server: --dynamic-batching false
    for workspace in (100, 100, 400):  # three one-row requests waiting, no bytes of their own
        budget.admit(0, 1, workspace)
    assert budget.held == 400  # one request a run: the largest
    budget.provide_for(8, padded_runs=False)  # a model batching up to 8 rows
    assert budget.held == 600  # one run may take all three
    budget.provide_for(8, padded_runs=True)  # ... padded to the longest
    assert budget.held == 1200


def test_export_s_template_sets_nothing_and_each_line_uncommented_sets_its_setting_at_the_default(tmp_path):
    settings = ServerSettings(max_queue_delay_us=500, max_sequence_length=1024)
    template = config_template("mha", {"d_model": 64, "num_heads": 4, "precision": "fp32"}, settings)
    (tmp_path / "config.pbtxt").write_text(template)
    assert model_settings(settings, tmp_path).configured == frozenset()  # the flags apply
    settings_lines = template.splitlines()[-(len(PARAMETERS) - 1) :]
    assert all(line.startswith("# ") for line in settings_lines)  # the queue's delay and size share a line
    set_by_lines = set()
    for line in settings_lines:
        (tmp_path / "config.pbtxt").write_text(template.replace(line, line[2:]))
        read = model_settings(settings, tmp_path)
        assert read.configured and read.as_text() == ModelSettings.of_server(settings).as_text(), line
        set_by_lines |= read.configured
    assert set_by_lines == set(PARAMETERS)


def test_a_model_asks_for_live_parity_in_its_config_and_a_share_past_one_is_refused(tmp_path):
    (tmp_path / "config.pbtxt").write_text('parameters { key: "parity_share" value { string_value: "0.01" } }')
    assert model_settings(ServerSettings(), tmp_path).parity_share == 0.01
    (tmp_path / "config.pbtxt").write_text('parameters { key: "parity_share" value { string_value: "1.5" } }')
    with pytest.raises(ModelConfigError, match="parity_share"):
        model_settings(ServerSettings(), tmp_path)


def test_tritons_preferred_batch_size_is_said_in_the_log_as_read_past(tmp_path, caplog):
    (tmp_path / "config.pbtxt").write_text("dynamic_batching { preferred_batch_size: [4, 8] }")
    with caplog.at_level("WARNING", logger="mhaserve.server"):
        settings = model_settings(ServerSettings(), tmp_path)
    assert settings.dynamic_batching
    (line,) = [record.getMessage() for record in caplog.records]
    assert "preferred_batch_size is read past: a free worker takes what is queued" in line


def test_priority_levels_are_read_as_triton_writes_them_and_a_default_outside_them_refused(tmp_path):
    (tmp_path / "config.pbtxt").write_text("dynamic_batching { priority_levels: 3 default_priority_level: 2 }")
    settings = model_settings(ServerSettings(), tmp_path)
    assert (settings.priority_levels, settings.default_priority_level) == (3, 2)
    (tmp_path / "config.pbtxt").write_text("dynamic_batching { priority_levels: 3 }")  # its default left at 0
    with pytest.raises(ModelConfigError, match="config.pbtxt: --default-priority-level 0 is not a level of the 3"):
        model_settings(ServerSettings(), tmp_path)
    with pytest.raises(UsageError, match="--default-priority-level 4 is not a level of the 3"):
        check_settings(ServerSettings(priority_levels=3, default_priority_level=4))


def test_triton_s_priority_queue_policy_gives_levels_their_own_queue_policy(tmp_path):
    (tmp_path / "config.pbtxt").write_text("""dynamic_batching { priority_levels: 2 default_priority_level: 2
        priority_queue_policy { key: 1 value { default_timeout_microseconds: 500 allow_timeout_override: true } }
        priority_queue_policy { key: 2 value { max_queue_size: 8 } } }""")
    model = model_settings(ServerSettings(), tmp_path)
    assert level_policies(model.priority_queue_policy) == {
        1: LevelPolicy(default_timeout_microseconds=500, allow_timeout_override=True),
        2: LevelPolicy(max_queue_size=8),
    }
    chosen = {"priority_levels": 2, "default_priority_level": 1, "priority_queue_policy": model.priority_queue_policy}
    (tmp_path / "config.pbtxt").write_text(config_text("mha", chosen))
    assert model_settings(ServerSettings(), tmp_path).priority_queue_policy == model.priority_queue_policy


@pytest.mark.parametrize(
    "written, says",
    [
        ("priority_levels: 2 default_priority_level: 1 priority_queue_policy { key: 3 value { } }",
         "names level 3, past the last of 2 priority levels"),
        ("priority_levels: 1 default_priority_level: 1 priority_queue_policy { key: 1 value { timeout_action: 1 } }",
         "timeout_action DELAY is not supported"),
    ],
)  # fmt: skip
def test_a_level_s_queue_policy_that_cannot_be_served_is_refused_naming_the_file(tmp_path, written, says):
    (tmp_path / "config.pbtxt").write_text(f"dynamic_batching {{ {written} }}")
    with pytest.raises(ModelConfigError, match=says):
        model_settings(ServerSettings(), tmp_path)
