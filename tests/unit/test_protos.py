"""The protocol stubs: committed stubs are current, and our messages match the published ones field by field."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.support import CLIENT_SCRIPTS, ROOT

DUMP = CLIENT_SCRIPTS / "dump_descriptors.py"


def test_committed_stubs_are_not_stale():
    pytest.importorskip("grpc_tools")
    done = subprocess.run(
        [sys.executable, str(ROOT / "protos" / "generate.py"), "--check"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def dump(which):
    done = subprocess.run([sys.executable, str(DUMP), which], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


# Ours alone, on numbers the published messages leave unused, so that their clients skip them (live parity).
EXTENSIONS = {"ModelMetadataResponse": {"parameters"}, "ModelStatistics": {"parity"}}
OWN_MESSAGES = {"ParityStatistics", "ParityStatistics.WorstErrorEntry", "ModelMetadataResponse.ParametersEntry"}


def test_messages_and_field_numbers_are_the_published_ones():
    if importlib.util.find_spec("tritonclient") is None:  # looked up, not imported (see clients/)
        pytest.skip("tritonclient is not installed")
    ours, published = dump("mhaserve"), dump("tritonclient")
    assert ours["service"] == published["service"] == "inference.GRPCInferenceService"
    for rpc, types in ours["rpcs"].items():
        assert published["rpcs"][rpc] == types, rpc
    for message, fields in ours["messages"].items():
        if message in OWN_MESSAGES:
            continue
        assert message in published["messages"], message
        theirs = published["messages"][message]
        for field, spec in fields.items():
            if field in EXTENSIONS.get(message, ()):
                assert field not in theirs and spec[0] not in {n for n, *_ in theirs.values()}, f"{message}.{field}"
            else:
                assert theirs.get(field) == spec, f"{message}.{field}"
    # the core protocol messages are complete, not a subset
    core = ["ModelInferRequest", "ModelInferResponse", "ModelMetadataResponse", "InferTensorContents", "InferParameter"]
    for message in core:
        extended = EXTENSIONS.get(message, set())
        mine = {field: spec for field, spec in ours["messages"][message].items() if field not in extended}
        assert mine == published["messages"][message], message
