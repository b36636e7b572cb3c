"""The server's metadata lists the protocol extensions it answers, and only those."""

from __future__ import annotations

from mhaserve.server.describe import server_metadata


def test_every_extension_is_listed_where_every_call_is_answered_and_shared_memory_only_where_allowed():
    assert server_metadata()["extensions"] == [
        "model_configuration", "model_repository", "statistics", "binary_tensor_data", "trace", "logging"
    ]  # fmt: skip
    assert server_metadata(shared_memory=True)["extensions"][-1] == "system_shared_memory"


def test_where_only_some_calls_are_answered_only_their_extensions_are_listed():
    answered = frozenset({"ServerLive", "ServerMetadata", "ModelConfig", "ModelStatistics", "ModelInfer"})
    assert server_metadata(shared_memory=True, rpcs=answered)["extensions"] == ["model_configuration", "statistics"]
