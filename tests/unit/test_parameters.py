"""Request parameters read by type, whatever the transport carried: a value of the wrong kind is refused
INVALID_ARGUMENT naming the parameter, what it takes and what came, clipped; sequences' ids are only real ids."""

from __future__ import annotations

import pytest

from mhaserve.server.errors import ErrorKind, RequestError
from mhaserve.server.parameters import (
    QUOTED_AT_MOST,
    UINT64_MAX,
    SequenceParameters,
    boolean,
    integer,
    number,
    quoted,
    sequence_parameters,
    text,
)


def refusal(call) -> str:
    with pytest.raises(RequestError) as refused:
        call()
    assert refused.value.kind is ErrorKind.INVALID_ARGUMENT
    return refused.value.message


def test_an_integer_comes_as_a_number_without_a_fraction_or_as_its_text():
    assert integer(3, "attn_top_k", 1, 8) == 3
    assert integer(3.0, "attn_top_k", 1, 8) == 3  # JSON writers send 3.0 for 3
    assert integer(" 5 ", "attn_top_k", 1, 8) == 5
    assert "must be an integer, got a number 2.5" in refusal(lambda: integer(2.5, "attn_top_k", 1, 8))
    assert "got a boolean True" in refusal(lambda: integer(True, "attn_top_k", 1, 8))
    message = refusal(lambda: integer(9, "attn_top_k", 1, 8, "the model's heads"))
    assert message == "parameter 'attn_top_k': 9 is outside 1..8, the model's heads"


def test_a_number_must_be_finite_and_within_its_span_open_or_closed():
    assert number("0.5", "attn_top_p", 0, 1, low_open=True) == 0.5
    assert number(1, "attn_top_p", 0, 1, low_open=True) == 1.0
    assert "in (0, 1], got 0" in refusal(lambda: number(0, "attn_top_p", 0, 1, low_open=True))
    assert "in [0, 1], got a string 'nan'" in refusal(lambda: number("nan", "attn_top_p", 0, 1))
    assert "got an array [1]" in refusal(lambda: number([1], "attn_top_p", 0, 1))


def test_text_takes_strings_and_integers_and_booleans_only_as_booleans():
    assert text("mean", "attn_output") == "mean" and text(3, "attn_heads") == "3"
    assert "must be a string, got a boolean False" in refusal(lambda: text(False, "attn_output"))
    assert boolean(True, "sequence_end") is True
    assert "must be true or false, got a string 'true'" in refusal(lambda: boolean("true", "sequence_end"))
    assert "got null None" in refusal(lambda: boolean(None, "sequence_end"))


def test_a_client_s_long_value_is_quoted_clipped_with_its_length():
    long = "x" * 20_000
    assert quoted("short") == "'short'"
    clipped = quoted(long)
    assert clipped.startswith("'xxx") and clipped.endswith("(20002 characters)")
    assert len(clipped) < QUOTED_AT_MOST + 30
    assert len(refusal(lambda: integer(long, "attn_top_k", 1, 8))) < 200


def test_a_sequence_step_is_an_id_and_its_start_and_end():
    assert sequence_parameters({}) is None
    assert sequence_parameters({"sequence_id": 0}) is None and sequence_parameters({"sequence_id": ""}) is None
    assert sequence_parameters({"sequence_id": 7, "sequence_start": True}) == SequenceParameters(7, True, False)
    ended = sequence_parameters({"sequence_id": "chat-1", "sequence_end": True})
    assert ended == SequenceParameters("chat-1", False, True)
    assert sequence_parameters({"sequence_id": UINT64_MAX}).id == UINT64_MAX


@pytest.mark.parametrize(
    ("sequence_id", "said"),
    [
        (False, "must be an integer or a string, got a boolean False"),  # equal to 0: would pass for no sequence
        (True, "must be an integer or a string, got a boolean True"),
        (0.0, "must be an integer or a string, got a number 0.0"),
        (42.0, "must be an integer or a string, got a number 42.0"),
        (-1, "must be an unsigned 64-bit integer, got -1"),
        (UINT64_MAX + 1, "must be an unsigned 64-bit integer"),
        ("x" * 257, "at most 256 characters, got 257"),
    ],
)
def test_only_real_ids_are_ids(sequence_id, said):
    assert said in refusal(lambda: sequence_parameters({"sequence_id": sequence_id}))


def test_a_start_or_end_without_an_id_is_refused_rather_than_answered_outside_any_sequence():
    message = refusal(lambda: sequence_parameters({"sequence_start": True}))
    assert "need a 'sequence_id'" in message
    assert "need a 'sequence_id'" in refusal(lambda: sequence_parameters({"sequence_id": 0, "sequence_end": True}))
