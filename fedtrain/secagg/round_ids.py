"""Protocol round ids, and the round and attempt an operator knows them by.

Every message, share encryption and mask seed of a secure round is bound to its round
id, so a retried round needs a fresh id: a late message from a failed attempt must
never pass for one of its retry. A driver that retries (the runtime) numbers attempt
`a` of round `r` as ``r * 10^6 + a``; one that never retries (the simulation) may use
the round number itself. A secure evaluation is a masked sum of its own: its id is
the round's with the top bit set (`evaluation_id`), so it never shares an id with a
training attempt. `describe` reads every kind back for log lines and errors, so no
operator ever meets "round 10000001".
"""

from __future__ import annotations

from fedtrain.errors import SecAggError

#: Attempts per round that get distinct ids.
ATTEMPTS_PER_ROUND = 1_000_000
#: Set in the id of a round's secure evaluation (ids are 64-bit).
EVALUATION_BIT = 1 << 63


def round_id(server_round: int, attempt: int) -> int:
    """The protocol round id of `attempt` (1-based) of `server_round`."""
    if not 0 < attempt < ATTEMPTS_PER_ROUND:
        raise SecAggError(f"round {server_round}: attempt {attempt} is out of range")
    return server_round * ATTEMPTS_PER_ROUND + attempt


def evaluation_id(protocol_round: int) -> int:
    """The id of the secure evaluation after `protocol_round` (a round id as above).

    Evaluations are never retried, so one id per round suffices."""
    if not 0 <= protocol_round < EVALUATION_BIT:
        raise SecAggError(f"round id {protocol_round} is out of range for an evaluation")
    return EVALUATION_BIT | protocol_round


def describe(protocol_round: int) -> str:
    """'round 10 (attempt 1)' for a runtime id, 'round 3' for a plain round number,
    "round 3's evaluation" for an evaluation's."""
    if protocol_round & EVALUATION_BIT:
        server_round = protocol_round & ~EVALUATION_BIT
        if server_round >= ATTEMPTS_PER_ROUND:
            server_round //= ATTEMPTS_PER_ROUND
        return f"round {server_round}'s evaluation"
    server_round, attempt = divmod(protocol_round, ATTEMPTS_PER_ROUND)
    if server_round == 0 or attempt == 0:
        return f"round {protocol_round}"
    return f"round {server_round} (attempt {attempt})"
