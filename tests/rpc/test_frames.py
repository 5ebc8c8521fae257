"""The step data plane's framing: whatever way the bytes are cut on the wire, the same frames come out in order;
a length past the limit drops the connection instead of buffering it."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.rpc.frames import MAX_FRAME_BYTES, FrameError, FrameProtocol, frame, token_accepted


class _Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.aborted = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def abort(self) -> None:
        self.aborted = True


class _Collect(FrameProtocol):
    def __init__(self) -> None:
        super().__init__()
        self.frames: list[bytes] = []
        self.errors: list[Exception | None] = []
        self.connection_made(_Transport())

    def frame_received(self, payload: bytes) -> None:
        self.frames.append(payload)

    def closed(self, error: Exception | None) -> None:
        self.errors.append(error)


@settings(max_examples=200, deadline=None)
@given(payloads=st.lists(st.binary(max_size=300), max_size=12), cuts=st.lists(st.integers(1, 64), max_size=40))
def test_frames_survive_any_cutting(payloads, cuts):
    wire = b"".join(frame(p) for p in payloads)
    protocol, offset = _Collect(), 0
    for cut in cuts:
        protocol.data_received(wire[offset:offset + cut])
        offset += cut
    protocol.data_received(wire[offset:])
    assert protocol.frames == payloads
    assert protocol._buffer == b""  # nothing held back once every frame is whole


def test_an_oversized_length_aborts_the_connection():
    protocol = _Collect()
    protocol.data_received(frame(b"ok") + (MAX_FRAME_BYTES + 1).to_bytes(4, "little") + b"xx")
    assert protocol.frames == [b"ok"]
    assert protocol.transport.aborted and protocol.is_closed
    assert len(protocol.errors) == 1 and isinstance(protocol.errors[0], FrameError)
    protocol.connection_lost(None)  # the transport's own notice afterwards: closed() is not told twice
    assert len(protocol.errors) == 1
    protocol.send(b"late")  # a closed protocol writes nothing
    assert protocol.transport.written == []


def test_token_check():
    assert token_accepted(None, b"") and token_accepted(None, b"anything")
    assert token_accepted("secret", b"secret")
    assert not token_accepted("secret", b"") and not token_accepted("secret", b"secreT")
