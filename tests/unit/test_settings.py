"""Server settings as ``mhaserve serve`` parses them, in process: every rule's refusal names the flag."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from mhaserve.contract.errors import UsageError
from mhaserve.server.config import SECTIONS, ServerSettings, add_server_arguments, settings_from_args


def settings(*flags: str) -> ServerSettings:
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    return settings_from_args(parser.parse_args(list(flags)))


def test_the_defaults_are_the_dataclass_defaults():
    assert settings() == ServerSettings()


def test_flags_set_their_fields_and_repeated_flags_add_up():
    parsed = settings("--max-batch-size", "4", "--dynamic-batching", "false", "--load-model", "a",
                      "--load-model", "b", "--model-repository", "r", "--model-control-mode", "explicit")  # fmt: skip
    assert parsed.max_batch_size == 4 and parsed.dynamic_batching is False and parsed.load_model == ("a", "b")


@pytest.mark.parametrize(
    "flags, words",
    [
        (("--max-batch-size", "0"), "--max-batch-size must be at least 1"),
        (("--sequence-idle-timeout-s", "0"), "--sequence-idle-timeout-s must be more than 0"),
        (("--drain-seconds", "-1"), "--drain-seconds must be 0 or more"),
        (("--inference-nice", "20"), "--inference-nice must be between 0 and 19"),
        (("--max-queue-delay-us", "-5"), "--max-queue-delay-us must be 0 or more"),
        (("--log-format", "xml"), "--log-format must be text or json, got 'xml'"),
        (("--device", "tpu"), "--device must be auto, cpu or cuda, got 'tpu'"),
        (("--intra-op-threads", "-3"), "--intra-op-threads must be 0 or a count up to the cores"),
        (("--intra-op-threads", "4096"), "got 4096 (it may use "),
        (("--trace-config", "rate=-1"), "--trace-config: trace_rate: expected 0..4294967295"),
        (("--model-control-mode", "explicit"), "need --model-repository"),
        (("--model-repository", "r", "--model-dir", "m"), "not both"),
        (("--model-repository", "r", "--version-policy", "newest"), "--version-policy"),
        (("--http-read-timeout-s", "0"), "--http-read-timeout-s must be more than 0"),
        (
            (
                "--priority-levels",
                "2",
                "--default-priority-level",
                "1",
                "--priority-queue-policy",
                "3:max_queue_size=1",
            ),
            "--priority-queue-policy names level 3, past the last of 2 priority levels",
        ),
        (("--priority-queue-policy", "1:max_queue_size=many"), "--priority-queue-policy must be LEVEL:max_queue_size="),
        (("--priority-queue-policy", "0:max_queue_size=1"), "got '0:max_queue_size=1'"),
        (("--priority-queue-policy", "1:timeout=5"), "got '1:timeout=5'"),
        (("--http-cors-origins", "app.example"), "--http-cors-origins must be '*' or origins like https://host:8443"),
        (("--http-cors-origins", "https://a.example/page"), "got 'https://a.example/page'"),
        (("--http-cors-origins", "*,https://a.example"), "--http-cors-origins must be '*' or origins"),
    ],
)
def test_a_setting_that_cannot_work_is_refused_naming_its_flag(flags, words):
    with pytest.raises(UsageError) as refused:
        settings(*flags)
    assert words in str(refused.value)


def test_every_setting_has_a_section_and_help_lists_them_by_section():
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    titles = [group.title for group in parser._action_groups if group.title in SECTIONS]
    assert titles == list(SECTIONS)
    listed = {
        action.dest for group in parser._action_groups if group.title in SECTIONS for action in group._group_actions
    }
    assert listed == {f.name for f in fields(ServerSettings)}
    text = parser.format_help()
    batching = text.index("\nbatching:")
    assert batching < text.index("--max-queue-delay-us", batching) < text.index("\nsequences:")


def test_each_section_declares_its_settings_and_keeps_its_own_rules():
    from mhaserve.server.config import SECTION_CLASSES, RepositorySettings, check_settings

    declared = [name for section in SECTION_CLASSES for name in section.own_fields()]
    assert sorted(declared) == sorted(f.name for f in fields(ServerSettings))  # each setting in one section
    assert "max_batch_size" in next(s for s in SECTION_CLASSES if s.title == "batching").own_fields()
    both = ServerSettings(model_dir="m", model_repository="r")
    with pytest.raises(UsageError, match="not both"):
        RepositorySettings.check(both)  # the repository section's rule across its own fields
    with pytest.raises(UsageError, match="not both"):
        check_settings(both)  # and so the server's, whichever way the settings were made
    check_settings(ServerSettings())


def test_message_limits_carry_the_largest_request_and_answer_unless_set():
    derived = settings("--max-batch-size", "2", "--max-q-len", "8", "--max-kv-len", "8")
    receive, send = derived.message_limits(64, 4)
    largest_request = 4 * 2 * 64 * (8 + 2 * 8) + 8 * 2 * 8 * 8
    largest_answer = 4 * 2 * 8 * 64 + 4 * 2 * 5 * 8 * 8
    assert receive == largest_request + (1 << 20) and send == largest_answer + (1 << 20)
    assert settings("--max-message-bytes", "12345").message_limits(64, 4) == (12345, 12345)


def test_compose_and_env_say_only_what_differs_from_the_defaults():
    # A default repeated in .env or docker-compose.yml goes stale when the server's changes.
    import re

    from mhaserve.server.config import ServerSettings, parse_bool
    from tests.support import ROOT

    defaults = ServerSettings()
    said = [line.split("=", 1) for line in (ROOT / ".env").read_text().splitlines() if line[:1].isalpha()]
    compose = (ROOT / "docker-compose.yml").read_text()
    said += re.findall(r"^\s+(MHASERVE_[A-Z_]+): \$\{MHASERVE_[A-Z_]+:-([^}]*)\}", compose, flags=re.M)
    said += re.findall(r"^\s+(MHASERVE_[A-Z_]+): ([^$\s][^#\n]*?)\s*(?:#.*)?$", compose, flags=re.M)
    repeated = []
    for variable, value in said:
        name = variable.removeprefix("MHASERVE_").lower()
        if not hasattr(defaults, name) or value.strip('"') == "":
            continue
        default = getattr(defaults, name)
        kind = type(default)
        text = value.strip('"')
        taken = parse_bool(text) if kind is bool else kind(text) if kind in (int, float) else text
        if taken == default:
            repeated.append(f"{variable}={value}")
    assert not repeated, repeated


def test_an_empty_variable_is_the_default(monkeypatch):
    # Compose passes a variable the environment does not set as empty.
    import argparse

    from mhaserve.server.config import ServerSettings, add_server_arguments, settings_from_args

    monkeypatch.setenv("MHASERVE_MAX_BATCH_SIZE", "")
    monkeypatch.setenv("MHASERVE_DYNAMIC_BATCHING", "")
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    settings = settings_from_args(parser.parse_args([]))
    assert (settings.max_batch_size, settings.dynamic_batching) == (ServerSettings().max_batch_size, True)
