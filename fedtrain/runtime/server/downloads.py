"""What a model download sends: the encoding a site is served, made once per version.

The server's `[download]` table offers a codec (`fedtrain.compression.downlink`); a
site is served it only if it announced the capabilities it needs at join, and gets
the model in its own dtypes otherwise. The site cannot ask for anything else: its
request names a model version and, at most, the reference version it holds (which
only decides between the change and the whole reference, both of which the server
offers). Thousands of sites downloading the same version would otherwise encode it
thousands of times: each encoding of a version, and its wire bytes for models up to
`SHARED_DOWNLOAD_BYTES`, is made once and the same objects go to every site's stream;
they are let go when the next global model is first downloaded.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import threading
from collections.abc import Awaitable, Callable, Collection, Iterator
from typing import Any, TypeVar

from fedtrain.compression.downlink import (
    Download,
    ReferenceTrack,
    cast,
    required_capabilities,
)
from fedtrain.compression.settings import DownloadSettings
from fedtrain.runtime import wire
from fedtrain.runtime.proto import fedtrain_pb2 as pb
from fedtrain.runtime.server.global_model import GlobalModel
from fedtrain.tensors import Chunk, ModelState

#: Encodings up to this size are turned into wire bytes once per version and the same
#: bytes are sent to every site; larger ones are encoded chunk by chunk per download
#: (a second copy of a large model would cost more memory than the encoding saves).
SHARED_DOWNLOAD_BYTES = 256 << 20
_T = TypeVar("_T")
Run = Callable[..., Awaitable[Any]]


class SharedDownloads:
    """Serves model downloads: the manifest and chunks of the encoding a site gets."""

    def __init__(self, chunk_bytes: int, settings: DownloadSettings) -> None:
        self.chunk_bytes = chunk_bytes
        self.settings = settings
        self.codec = settings.build()
        #: What a site must announce at join to be served `settings` (empty: nothing
        #: is offered beyond the model's own dtypes).
        self.required = required_capabilities(settings.codec, settings.delta)
        self.track = ReferenceTrack(self.codec) if settings.delta else None
        self._track_lock = threading.Lock()  # advanced on the CPU pool
        #: The current version's encodings (plain, cast, or the track's change and
        #: whole reference) and their wire bytes, each made once.
        self._version = ""
        self._made: dict[tuple[str, ...], asyncio.Future[Any]] = {}

    def serves(self, capabilities: Collection[str]) -> bool:
        """Whether a site with these join capabilities is served the encoded downloads."""
        return bool(self.required) and self.required <= set(capabilities)

    async def prepare(
        self,
        model: GlobalModel,
        *,
        encoded: bool,
        current: bool,
        held: str,
        run: Run,
        ranged: bool = False,
    ) -> tuple[pb.Manifest, Pieces]:
        """The manifest and (what to yield, tensor bytes) of every chunk a site gets.

        `encoded`: the site is served the offered codec (`serves`); `current`: `model` is
        the server's current global model, the only one encoded and shared (an older
        FedBuff version travels as itself, chunked per download); `held`: the reference
        version the site says it holds; `run`: runs a function on the CPU pool;
        `ranged`: for one of parallel streams, in pieces of `wire.RANGE_CHUNK_BYTES`
        (the same bytes in the same order, cut finer, so that there are enough ranges);
        else in chunks of chunk_bytes, but for a download the site may cut for parallel
        streams, whose first `wire.HEAD_BYTES` come in those pieces (the site measures
        its call's rate from them)."""
        if not current:
            plain = Download(model.version, model.state)
            pieces = _Chunked(lambda: self._chunks(model.state, ranged))
            return self._manifest(model, plain), pieces
        if model.version != self._version:  # a new global model: the last one's encodings go
            self._version = model.version
            self._made.clear()
        download = await self._download(model, encoded, held, run)
        key = (model.version, download.codec, download.base, str(download.reference))
        parts = download.parts
        kind = "ranged" if ranged else "plain"
        pieces = await self._once((*key, "pieces", kind), run, self._pieces, parts, ranged)
        # (once too: parallel streams ask for the manifest with every range)
        manifest = await self._once((*key, "manifest"), run, self._manifest, model, download)
        return manifest, pieces

    async def _download(self, model: GlobalModel, encoded: bool, held: str, run: Run) -> Download:
        if not encoded:
            return Download(model.version, model.state)
        if self.track is None:
            key = (model.version, "cast")
            return await self._once(key, run, cast, self.codec, model.version, model.state)
        change, whole = await self._once((model.version, "track"), run, self._advance, model)
        return change if change is not None and held and held == change.base else whole

    async def _once(self, key: tuple[str, ...], run: Run, fn: Callable[..., _T], *args: Any) -> _T:
        """`fn(*args)`, computed once on the CPU pool for every site that needs it."""
        future = self._made.get(key)
        if future is None:
            future = asyncio.ensure_future(run(fn, *args))
            future.add_done_callback(lambda f: self._forget_failed(key, f))
            self._made[key] = future
        return await asyncio.shield(future)  # type: ignore[no-any-return]

    def _forget_failed(self, key: tuple[str, ...], future: asyncio.Future[Any]) -> None:
        """A failed encoding is made again by the next download, not served as failed."""
        if (future.cancelled() or future.exception() is not None) and self._made.get(key) is future:
            del self._made[key]

    def _pieces(self, parts: ModelState, ranged: bool) -> Pieces:
        if parts.nbytes > SHARED_DOWNLOAD_BYTES:
            return _Chunked(lambda: self._chunks(parts, ranged))
        chunks = self._chunks(parts, ranged)
        return _Encoded([(wire.encode_chunk_message(c), len(c.data)) for c in chunks])

    def _chunks(self, parts: ModelState, ranged: bool) -> Iterator[Chunk]:
        """What a download of `parts` sends: for parallel streams every chunk in range
        pieces; else those in the first HEAD_BYTES of a download the site may cut."""
        until = None if ranged else wire.head_bytes(parts.nbytes)
        return wire.cut_chunks(parts.chunks(self.chunk_bytes), wire.RANGE_CHUNK_BYTES, until)

    def _advance(self, model: GlobalModel) -> tuple[Download | None, Download]:
        """Move the reference track to `model`: (the change from the previous reference,
        None at the track's first version; the whole reference)."""
        assert self.track is not None
        with self._track_lock:
            self.track.advance(model.version, model.state)
            return self.track.change, self.track.whole()

    def _manifest(self, model: GlobalModel, download: Download) -> pb.Manifest:
        manifest = wire.manifest(model.version, model.state.specs)
        manifest.total_bytes = download.nbytes
        manifest.reference = download.reference
        if download.codec != "none":
            manifest.codec = download.codec
            manifest.parts.extend(wire.spec_to_proto(s) for s in download.parts.specs)
        manifest.base_version = download.base
        manifest.digest = download.digest
        return manifest


class Pieces:
    """What a download sends: (what to yield, tensor bytes) per chunk, in order."""

    def __iter__(self) -> Iterator[tuple[bytes | Chunk, int]]:
        raise NotImplementedError

    def from_offset(self, offset: int) -> tuple[int, Iterator[tuple[bytes | Chunk, int]]]:
        """The pieces that start at or after byte `offset`, and the byte the first of
        them starts at (the total when none does)."""
        walk, position = iter(self), 0
        for piece, size in walk:
            if position >= offset:
                return position, itertools.chain([(piece, size)], walk)
            position += size
        return position, iter(())


class _Encoded(Pieces):
    """A shared encoding's chunks as wire bytes, with the byte each starts at: a range
    (or a resume) starts at its first chunk without walking those before it (a ranged
    download is ~600 pieces of 64 KiB and hundreds of range requests)."""

    def __init__(self, pieces: list[tuple[bytes, int]]) -> None:
        self.pieces = pieces
        self.starts = list(itertools.accumulate((size for _, size in pieces), initial=0))

    def __iter__(self) -> Iterator[tuple[bytes | Chunk, int]]:
        return iter(self.pieces)

    def from_offset(self, offset: int) -> tuple[int, Iterator[tuple[bytes | Chunk, int]]]:
        first = bisect.bisect_left(self.starts, offset)
        return self.starts[first], iter(self.pieces[first:])


class _Chunked(Pieces):
    """A large encoding's chunks, made afresh (as views) for every download (nothing to
    index: a range walks the views before it)."""

    def __init__(self, chunks: Callable[[], Iterator[Chunk]]) -> None:
        self.chunks = chunks

    def __iter__(self) -> Iterator[tuple[bytes | Chunk, int]]:
        return ((c, len(c.data)) for c in self.chunks())
