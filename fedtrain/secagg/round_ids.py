"""Protocol round ids, and the round and attempt an operator knows them by.

Every message, share encryption and mask seed of a secure round is bound to its round
id, so a retried round needs a fresh id: a late message from a failed attempt must
never pass for one of its retry. A driver that retries (the runtime) numbers attempt
`a` of round `r` as ``r * 10^6 + a``; one that never retries (the simulation) may use
the round number itself. `describe` reads either back for log lines and errors, so
no operator ever meets "round 10000001".
"""

from __future__ import annotations

from fedtrain.errors import SecAggError

#: Attempts per round that get distinct ids.
ATTEMPTS_PER_ROUND = 1_000_000


def round_id(server_round: int, attempt: int) -> int:
    """The protocol round id of `attempt` (1-based) of `server_round`."""
    if not 0 < attempt < ATTEMPTS_PER_ROUND:
        raise SecAggError(f"round {server_round}: attempt {attempt} is out of range")
    return server_round * ATTEMPTS_PER_ROUND + attempt


def describe(protocol_round: int) -> str:
    """'round 10 (attempt 1)' for a runtime id, 'round 3' for a plain round number."""
    server_round, attempt = divmod(protocol_round, ATTEMPTS_PER_ROUND)
    if server_round == 0 or attempt == 0:
        return f"round {protocol_round}"
    return f"round {server_round} (attempt {attempt})"
