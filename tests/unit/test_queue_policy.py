"""A model's queue policy, as Triton reads a request's timeout and priority against it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mhaserve.server.errors import RequestError
from mhaserve.server.runtime import QueuePolicy


def terms(policy: QueuePolicy, **parameters):
    return policy.terms_of(SimpleNamespace(parameters=parameters))


def test_a_requests_priority_is_its_level_and_none_or_one_past_the_last_is_the_default():
    policy = QueuePolicy(priority_levels=3, default_priority=2)
    levels = [terms(policy, **({} if asked is None else {"priority": asked})).priority
              for asked in (None, 0, 1, 2, 3, 4, 10**9)]  # fmt: skip
    assert levels == [2, 2, 1, 2, 3, 2, 2]
    assert terms(QueuePolicy(), priority=1).priority == 0  # no levels: first come, first served


def test_a_requests_timeout_shortens_the_models_only_where_allowed_and_never_lengthens_it():
    allowed = QueuePolicy(timeout_us=100_000, allow_override=True, set_by="--queue-timeout-us")
    assert terms(allowed).timeout.seconds == 0.1
    assert (terms(allowed, timeout=20_000).timeout.seconds, terms(allowed, timeout=20_000).timeout.set_by) == (
        0.02, "the request's 'timeout' parameter"
    )  # fmt: skip
    assert terms(allowed, timeout=500_000).timeout.seconds == 0.1
    assert terms(QueuePolicy(timeout_us=100_000), timeout=20_000).timeout.seconds == 0.1  # not allowed
    assert terms(QueuePolicy(allow_override=True), timeout=20_000).timeout is None  # no model timeout: none


@pytest.mark.parametrize("parameters", [{"timeout": "soon"}, {"priority": -1}, {"priority": 1.5}])
def test_malformed_queue_parameters_are_refused_whatever_the_policy(parameters):
    with pytest.raises(RequestError, match="parameter '(timeout|priority)'"):
        terms(QueuePolicy(), **parameters)
