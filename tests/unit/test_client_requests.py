"""What the project's clients put in a request beside its tensors: its priority level, as Triton's clients do."""

from __future__ import annotations

import json

import pytest

from mhaserve.client.grpc import build_infer_request
from mhaserve.client.http import build_http_infer_body
from tests.support import SMALL_D_MODEL, rand


def test_a_priority_level_is_sent_as_tritons_priority_parameter_and_none_is_not_sent():
    query = rand(1, 2, SMALL_D_MODEL)
    assert build_infer_request("mha", query, priority=2).parameters["priority"].int64_param == 2
    assert "priority" not in build_infer_request("mha", query).parameters
    body, headers = build_http_infer_body(query, priority=2)
    header = json.loads(body[: int(headers["Inference-Header-Content-Length"])])
    assert header["parameters"] == {"priority": 2}


@pytest.mark.parametrize("priority", [-1, 1.5, True])
def test_a_priority_that_is_no_level_is_refused_before_the_call(priority):
    with pytest.raises(ValueError, match="priority must be a level"):
        build_infer_request("mha", rand(1, 2, SMALL_D_MODEL), priority=priority)
