"""Messages between the engine process and its API server processes, over a private socket pair.

Every message is one frame: a 4-byte little-endian length, then the message pickled (protocol 5). Pickle, because
both ends are this package's own processes joined by a socketpair their parent made (no address anyone else can
reach), and because the per-step message is mostly small tuples and ints, which pickle writes in microseconds.

API server -> engine:
- ("add", key, GenerationRequest): admit a request; `key` is the API server's int for it in later messages.
- ("finish", key, reason): end it early: "abort" (the client went away) or "stop" (a stop string was found).
- ("stats", tag): ask for an EngineStats snapshot and the switch totals (answered with ("stats", tag, ...)).
- ("metrics", tag, samples): the API server's request latencies since its last report; with a tag, the engine
  answers with the whole /metrics exposition (("metrics", tag, bytes)).

Engine -> API server:
- ("hello", EngineInfo): right after the connection opens.
- ("out", outputs): what the requests of this API server produced since the last message, one tuple per request:
  (key, new_token_ids, finish_reason or None, error or None, logprobs, prompt_logprobs or None). One message per
  step (all that one turn of the engine's loop produced), whatever the batch.
- ("refused", key, kind, message, retry_after_s): an "add" the engine did not admit (kind: "queue_full",
  "invalid" or "draining").
- ("state", is_ready, is_draining): when either changes.
"""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct
from dataclasses import dataclass

_LENGTH = struct.Struct("<I")
MAX_FRAME_BYTES = 1 << 30


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What an API server needs of the engine once, at connection time."""

    model_name: str
    model_dir: str
    max_model_len: int
    context_note: str
    vocab_size: int | None


def send(writer: asyncio.StreamWriter, message: object) -> None:
    """Queue one message on the connection (never blocks: the transport buffers what the peer has not read)."""
    payload = pickle.dumps(message, protocol=5)
    writer.write(_LENGTH.pack(len(payload)) + payload)


async def receive(reader: asyncio.StreamReader) -> object | None:
    """The next message; None when the peer closed the connection."""
    try:
        header = await reader.readexactly(_LENGTH.size)
        (length,) = _LENGTH.unpack(header)
        if length > MAX_FRAME_BYTES:
            raise ValueError(f"a frame of {length} bytes")
        return pickle.loads(await reader.readexactly(length))
    except (asyncio.IncompleteReadError, ConnectionResetError):
        return None


async def open_streams(sock: socket.socket) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """asyncio streams over one end of a socket pair (on the running loop)."""
    sock.setblocking(False)
    return await asyncio.open_unix_connection(sock=sock, limit=1 << 24)
