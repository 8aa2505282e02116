"""A model download's chunks turned into the model the site trains from.

The server sends the model in its own dtypes, a codec's parts of it (cast), or the
change from the reference model the site holds (`fedtrain.compression.downlink`);
the manifest says which. Everything it says is checked against what this site was
told at join and what it holds, so a confused or lying server gets an error that
names the model version, never a silently wrong model: a codec this site was not
told, parts that do not fit the model, a change from a version it does not hold, or
a sum whose digest differs from the server's reference.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from fedtrain.compression import Codec, downlink
from fedtrain.errors import ProtocolError, UpdateRejected
from fedtrain.runtime import wire
from fedtrain.runtime.proto import fedtrain_pb2 as pb
from fedtrain.tensors import Chunk, ModelState, StateAssembler


class DigestMismatch(ProtocolError):
    """The model rebuilt from a change differs from the server's reference: ask again,
    for the whole model."""


def receive_model(
    manifest: pb.Manifest,
    chunks: Iterable[Chunk],
    codec: Codec | None,
    previous: ModelState | None,
    held: str,
) -> tuple[ModelState, bool]:
    """(the model, whether it is the server's reference of its version) from a download.

    `codec`: the download codec told at join (None: none); `previous`: the model this
    site holds; `held`: the reference version the request named ("" if none). With
    `held`, `previous` is left untouched until a whole change has arrived and decodes
    (then the change is added into it); without, its memory receives the model."""
    where = f"model {manifest.model_version[:12]}"
    specs = tuple(wire.spec_from_proto(s) for s in manifest.specs)
    name = manifest.codec or "none"
    base = manifest.base_version
    if name != "none" and (codec is None or codec.name != name):
        told = codec.name if codec is not None else "none"
        raise ProtocolError(
            f"{where} arrives encoded with {name!r}, but the server told this site {told!r} at join"
        )
    if base and (name == "none" or not held or base != held or previous is None):
        raise ProtocolError(
            f"{where} arrives as a change from version {base[:12]}, but this site "
            f"asked as holder of {held[:12] or 'no version'}"
        )
    if base and previous is not None and previous.specs != specs:
        raise ProtocolError(f"{where}: its tensors differ from those of the model held")
    if name == "none":
        if manifest.parts:
            raise ProtocolError(f"{where}: parts listed for a model sent as itself")
        assembler = StateAssembler(specs, reuse=None if held else previous)
    else:
        assembler = StateAssembler([wire.spec_from_proto(s) for s in manifest.parts])
    for chunk in chunks:
        assembler.add(chunk)
    received = assembler.finish()
    if name == "none":
        return received, manifest.reference
    assert codec is not None
    try:
        if base:
            assert previous is not None
            state = downlink.apply_change(codec, received, previous)
        else:
            state = downlink.decode(codec, received, specs)
    except UpdateRejected as exc:
        raise ProtocolError(f"{where}: the {name} encoding does not decode: {exc}") from None
    if manifest.digest and state.digest() != manifest.digest:
        raise DigestMismatch(
            f"{where}: the model rebuilt from the change from {base[:12]} differs from the "
            "server's (digest mismatch)"
        )
    return state, manifest.reference


def receive_inline(
    version: str,
    pieces: Sequence[pb.ModelPiece],
    codec: Codec | None,
    previous: ModelState | None,
) -> tuple[ModelState, bool]:
    """(the model, whether it is the server's reference) from an instruction that carries
    it (`Instruction.model`): what a download would have sent, checked the same way."""
    head = pieces[0]
    if head.WhichOneof("kind") != "manifest":
        raise ProtocolError("a model inside an instruction must start with its manifest")
    if head.manifest.model_version != version:
        raise ProtocolError(
            f"the instruction names model {version[:12]} but carries "
            f"{head.manifest.model_version[:12]}"
        )
    if head.manifest.base_version:
        raise ProtocolError("a model inside an instruction must be whole, not a change")

    def chunks() -> Iterator[Chunk]:
        for piece in pieces[1:]:
            if piece.WhichOneof("kind") != "chunk":
                raise ProtocolError("a model inside an instruction has a second manifest")
            yield wire.chunk_from_proto(piece.chunk)

    return receive_model(head.manifest, chunks(), codec, previous, "")
