"""The worker's end of the step data plane: steps arrive as frames (services.rpc.frames) on a socket of their own,
run on the model thread in arrival order, and their results go back as frames in the same order."""

from __future__ import annotations

import asyncio
from collections import deque

import structlog
from google.protobuf.message import DecodeError

from services.contracts.step import StepOutput
from services.contracts.step_rows import rows_result
from services.rpc.frames import FrameError, FrameProtocol, token_accepted
from services.rpc.reconfig.v1 import worker_pb2
from services.rpc.tls import TLSConfig
from services.worker.server import WorkerServicer

log = structlog.get_logger(__name__)


class StepConnection(FrameProtocol):
    """One router's step stream: a greeting with the token, then StepRequest frames in, StepResult frames out."""

    def __init__(self, servicer: WorkerServicer, token: str | None) -> None:
        super().__init__()
        self.servicer = servicer
        self.token = token
        self.greeted = False
        self.pending: deque[tuple[asyncio.Future[StepOutput], tuple | None]] = deque()  # in arrival order

    def frame_received(self, payload: bytes) -> None:
        if not self.greeted:
            if not token_accepted(self.token, payload):
                log.warning("worker.step_stream_refused", rank=self.servicer.rank, reason="wrong token")
                self.send(b"the step stream needs the control-plane token (missing or wrong)")
                self.transport.close()
                return
            self.greeted = True
            self.send(b"")
            return
        try:
            request = worker_pb2.StepRequest.FromString(payload)
        except DecodeError as exc:
            self.abort(FrameError(f"a step frame that is no StepRequest: {exc}"))
            return
        future, rows = self.servicer.begin_step(request)
        self.pending.append((future, rows))
        future.add_done_callback(self._flush)

    def _flush(self, _: asyncio.Future | None = None) -> None:
        """Send the results of the steps done so far, in order (the model thread runs them in order anyway)."""
        pending = self.pending
        while pending and pending[0][0].done():
            future, rows = pending.popleft()
            if future.cancelled():  # the model thread was shut down: the worker is stopping
                continue
            output = future.result()  # _run_step answers errors as outputs: it does not raise
            self.send((output.to_pb() if rows is None else rows_result(output, rows)).SerializeToString())

    def closed(self, error: Exception | None) -> None:
        if error is not None and not isinstance(error, ConnectionResetError):
            log.warning("worker.step_stream_closed", rank=self.servicer.rank, error=str(error))


async def start_step_server(servicer: WorkerServicer, host: str, port: int, token: str | None = None,
                            tls: TLSConfig | None = None) -> tuple[asyncio.Server, int]:
    """Listen for step streams on host:port (0: any free port); returns the server and the bound port. With `tls`,
    mutual TLS only: a client without a certificate of the CA fails the handshake before its greeting is read."""
    loop = asyncio.get_running_loop()
    ssl = None if tls is None else tls.server_ssl_context()
    try:
        server = await loop.create_server(lambda: StepConnection(servicer, token), host.strip("[]"), port, ssl=ssl)
    except OSError as exc:
        raise OSError(exc.errno, f"worker: cannot listen for steps on {host}:{port}: {exc.strerror}") from None
    return server, server.sockets[0].getsockname()[1]
