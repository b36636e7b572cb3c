"""Where the anonymous sequences of a server of several workers live: a link each, that every worker reads."""

from mhaserve.server.worker_forward import SequenceHomes


def test_a_sequence_lives_where_it_was_claimed_and_a_later_start_elsewhere_takes_it(tmp_path):
    first, second = SequenceHomes(tmp_path / "homes", 0), SequenceHomes(tmp_path / "homes", 1)
    assert first.of("chat-1") is None and second.of("chat-1") is None
    first.claim("chat-1")
    assert first.of("chat-1") == second.of("chat-1") == 0
    assert second.of(1) is None  # an id's type is part of it, as in the sequences themselves
    second.claim("chat-1")  # started again in the other worker
    assert first.of("chat-1") == 1
    first.release("chat-1")  # the first forgets its old end: the link is no longer its own, and stays
    assert second.of("chat-1") == 1
    second.release("chat-1")
    assert first.of("chat-1") is None
    second.release("chat-1")  # nothing left to remove
    assert sorted(path.name for path in (tmp_path / "homes").iterdir()) == []
