"""A request's answer from its rows of a run, whichever runtime made the run: the outputs it asked for, in its
order, its weights shaped as it asked, and never an answer derived from a run that overflowed."""

from __future__ import annotations

import numpy as np

from mhaserve.contract.signature import ATTN_ENTROPY, ATTN_WEIGHTS, OUTPUT

from .errors import ErrorKind, RequestError
from .shaping import shaped_summaries, shaped_weights
from .tensors import count_non_finite


class ComputationOverflowed(RequestError):
    def __init__(self, asked: tuple[str, ...], checked: str, count: int, computed_in: str):
        derived = "" if asked == (checked,) else f", from which {', '.join(asked)} would be cut"
        super().__init__(
            ErrorKind.INVALID_ARGUMENT,
            f"the computation overflowed {computed_in}: output '{checked}' has {count} non-finite values (NaN or "
            f"Inf){derived}; inputs of this magnitude cannot be attended over in {computed_in}",
        )


def overflow_error(
    asked: tuple[str, ...], output: np.ndarray | None, weights: np.ndarray | None, computed_in: str = "float32"
) -> ComputationOverflowed | None:
    """The one check that no answer derived from an overflowed run is returned as OK, for every output a request
    can ask for, made on a request's rows of the run before anything is cut from them. Where the request asked for
    the output, its sum alone vouches for the rest: the weights are a softmax, in [0, 1] unless NaN, and a NaN
    weight makes its query row's output NaN through P·V (the zeroing of a fully masked row multiplies, which keeps
    NaN). That spares a pass over the weights, the largest tensor an answer holds. Otherwise every weights output
    (top-k values and indices, top-p, heads/rows/keys, the mean, float16) is cut from ``weights``, summed once: a
    NaN weight ranks anywhere in a top-k and makes a top-p row empty, so the cut answers cannot be checked."""
    checked, array = (OUTPUT, output) if output is not None else (ATTN_WEIGHTS, weights)
    if array is None:
        return None
    bad = count_non_finite(array)
    return ComputationOverflowed(asked, checked, bad, computed_in) if bad else None


def asks_for_weights(asked: tuple[str, ...]) -> bool:
    """Whether a request asking for these outputs needs the attention weights (any output but ``output`` is cut
    from them)."""
    return any(name != OUTPUT for name in asked)


def outputs_from_run(
    asked: tuple[str, ...],
    shaping,
    output: np.ndarray | None,
    weights: np.ndarray | None,
    computed_in: str,
    summarised: dict[str, np.ndarray] | None = None,
) -> tuple[dict[str, np.ndarray] | None, RequestError | None]:
    """A request's answer from its rows of a run (``output`` None where it did not ask for it), the outputs it
    asked for in its order, its weights shaped as it asked; or, where the run overflowed, no answer and the
    error (overflow_error). ``summarised``: the summaries a run of the summaries graph made, where it ran in place
    of the weights (then the entropy, which a NaN weight makes NaN, stands for them in the overflow check)."""
    derived = weights if asks_for_weights(asked) else None
    if derived is None and output is None and summarised:
        derived = summarised[ATTN_ENTROPY]
    error = overflow_error(asked, output, derived, computed_in)
    if error is not None:
        return None, error
    answer = {} if output is None else {OUTPUT: output}
    if weights is not None:
        answer.update(shaped_weights(weights, asked, shaping))
    elif summarised:
        answer.update(shaped_summaries(summarised, asked, shaping))
    return {name: answer[name] for name in asked}, None
