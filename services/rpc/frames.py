"""Length-prefixed frames over a plain stream socket: the step data plane between the router and its workers.

A step goes to a worker and its result comes back hundreds of times a second, so this link is not gRPC: a gRPC
stream message costs about 140 us of CPU to write and 110 us to read on each side in grpc.aio (measured on this
project's machines, 1 KB messages), as much as the whole rest of the router's step at batch 64. A frame is a 4-byte
little-endian length and that many bytes (a serialized protobuf: StepRequest in, StepResult out); both ends parse
them in asyncio protocol callbacks, with no task per message.

The connection opens with a greeting: the client's first frame is the control-plane token (empty when none is
set), the server answers with an empty frame (accepted) or an error message and closes. The control RPCs stay on
gRPC; a worker's StepRequest/StepResult schema stays in worker.proto.
"""

from __future__ import annotations

import asyncio
import hmac
import struct

_HEADER = struct.Struct("<I")
MAX_FRAME_BYTES = 256 << 20  # a prefill of a long prompt in the full form is a few MB; more is a broken peer


class FrameError(ValueError):
    """The peer sent something that is not a frame (a length over MAX_FRAME_BYTES)."""


def frame(payload: bytes) -> bytes:
    """The bytes of one frame carrying `payload`."""
    return _HEADER.pack(len(payload)) + payload


class FrameProtocol(asyncio.Protocol):
    """Splits what arrives into frames, in order, and hands each to frame_received; subclasses also get closed()
    once, with the reason (None: the peer closed cleanly)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self.is_closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        offset, size = 0, len(buffer)
        while size - offset >= 4:
            (length,) = _HEADER.unpack_from(buffer, offset)
            if length > MAX_FRAME_BYTES:
                self.abort(FrameError(f"a frame of {length} bytes (at most {MAX_FRAME_BYTES})"))
                return
            end = offset + 4 + length
            if end > size:
                break
            self.frame_received(bytes(buffer[offset + 4:end]))
            offset = end
            if self.is_closed:
                return
        if offset:
            del buffer[:offset]

    def send(self, payload: bytes) -> None:
        if self.transport is not None and not self.is_closed:
            self.transport.write(frame(payload))

    def abort(self, error: Exception) -> None:
        """Drop the connection now; closed() gets `error`."""
        self._close(error)
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._close(exc)

    def _close(self, error: Exception | None) -> None:
        if not self.is_closed:
            self.is_closed = True
            self._buffer.clear()
            self.closed(error)

    def frame_received(self, payload: bytes) -> None:
        raise NotImplementedError

    def closed(self, error: Exception | None) -> None:
        pass


def token_accepted(expected: str | None, offered: bytes) -> bool:
    """Whether a greeting's token is the one required (any, when none is set); constant time."""
    return expected is None or hmac.compare_digest(offered, expected.encode())
