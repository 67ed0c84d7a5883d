"""Moving a decode session between servers: ExportSession and ImportSession.

An export streams the session's file (the `--session_dir` format) in
chunks; `export_session` joins them and, when the stream breaks
(UNAVAILABLE), resumes it from the bytes it has, at the same session
version. `import_session` sends a file in chunks; given the session's id,
a stream that breaks is resumed from the bytes the server has taken. Both
retry a broken stream twice, as the C++ client does; any other error is
raised as the server's grpc.RpcError.
"""
import time

import grpc

from attnserve.v1 import attention_pb2 as pb

_RETRIES = 2


class TransferError(Exception):
    """A stream that ended short, or chunks out of order."""


class _StreamEnded(TransferError):
    """A stream that ended before the file did: resumed as UNAVAILABLE."""


class _Export:
    """An export's bytes so far and the version of the session they are of."""

    def __init__(self):
        self.data = bytearray()
        self.version = 0


def _export_stream(stub, session_id, export, call_options):
    chunks = stub.ExportSession(
        pb.ExportSessionRequest(session_id=session_id,
                                offset=len(export.data),
                                version=export.version), **call_options)
    size = 0
    for chunk in chunks:
        if chunk.offset != len(export.data):
            chunks.cancel()
            raise TransferError(
                f"export: a chunk at offset {chunk.offset} after "
                f"{len(export.data)} bytes")
        export.data += chunk.data
        export.version, size = chunk.version, chunk.size
    if len(export.data) != size:
        raise _StreamEnded(
            f"export: the stream ended after {len(export.data)} of {size} "
            "bytes")


def export_session(stub, session_id, **call_options):
    """The file of session `session_id`, as bytes.

    `stub` is an AttentionServiceStub; `call_options` (metadata, timeout...)
    go to each stream. A session stepped during the export ends it with
    ABORTED: export it again, or export a fork.
    """
    export = _Export()
    for attempt in range(_RETRIES + 1):
        try:
            _export_stream(stub, session_id, export, call_options)
            return bytes(export.data)
        except _StreamEnded:
            if attempt == _RETRIES:
                raise
        except grpc.RpcError as error:
            if (error.code() != grpc.StatusCode.UNAVAILABLE or
                    attempt == _RETRIES):
                raise
    raise AssertionError("unreachable")


def _import_chunks(session_id, data, offset, chunk_bytes):
    if offset >= len(data):
        # No bytes: a question, how far the import of session_id got.
        yield pb.ImportSessionChunk(session_id=session_id, offset=offset)
        return
    for at in range(offset, len(data), chunk_bytes):
        yield pb.ImportSessionChunk(
            session_id=session_id if at == offset else "", offset=at,
            data=bytes(data[at:at + chunk_bytes]))


def import_session(stub, data, session_id="", chunk_bytes=1 << 20,
                   **call_options):
    """Opens the session of file `data` (bytes an export gave) on `stub`'s
    server; returns its ImportSessionResponse (session_id, lengths).

    With `session_id` (the exported session's), an import this or an
    earlier call left under way goes on from the bytes the server took,
    and a stream that breaks is resumed.
    """
    chunk_bytes = max(1, int(chunk_bytes))
    for attempt in range(_RETRIES + 1):
        resumed, offset = "", 0
        if session_id:
            try:
                progress = stub.ImportSession(
                    _import_chunks(session_id, b"", 0, chunk_bytes),
                    **call_options)
                resumed, offset = session_id, progress.received
            except grpc.RpcError as error:
                if error.code() == grpc.StatusCode.UNAVAILABLE and \
                        attempt < _RETRIES:
                    # The stream that broke may hold the import until the
                    # server sees it end: ask again shortly.
                    time.sleep(0.1 * (attempt + 1))
                    continue
                if error.code() != grpc.StatusCode.NOT_FOUND:
                    raise
        try:
            response = stub.ImportSession(
                _import_chunks(resumed, data, offset, chunk_bytes),
                **call_options)
        except grpc.RpcError as error:
            if (error.code() != grpc.StatusCode.UNAVAILABLE or
                    not session_id or attempt == _RETRIES):
                raise
            continue
        if response.received == response.size:
            return response
        if not session_id or attempt == _RETRIES:
            raise TransferError(
                f"import: the server took {response.received} of the "
                f"file's {response.size} bytes")
    raise AssertionError("unreachable")
