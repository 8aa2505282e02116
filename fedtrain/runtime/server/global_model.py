"""The global model as the server holds it: one immutable record, replaced as a whole.

Its own module because the coordinator (which publishes it), FedBuff's loop (which
keeps older versions for sites still fetching them) and the servicer (which streams
it) all name it, and none of them should import another just for this type.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from fedtrain.tensors import ModelState


@dataclass(frozen=True)
class GlobalModel:
    """The current global model: replaced as a whole, so readers never see a mix."""

    round: int  # rounds completed when this model came out
    version: str  # new_model_version(): names this model on the wire and in the audit log
    state: ModelState


def new_model_version() -> str:
    """A fresh, unguessable name for a new global model.

    Not a hash of its bytes: hashing 400 MB takes ~0.3 s of CPU every round. The final
    model's SHA-256 is in the audit log's `run_completed` record. Random, not
    `run:round`, so a round re-run after a resume never reuses a name a site cached.
    """
    return secrets.token_hex(16)
