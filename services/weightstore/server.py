"""gRPC WeightStore service: a thin servicer over WeightStore, and the serve() lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import structlog

from services.rpc.reconfig.v1 import weightstore_pb2, weightstore_pb2_grpc
from services.rpc.server import listen, new_server
from services.rpc.tls import TLSConfig
from services.weightstore.shm import cleanup_stale_segments
from services.weightstore.store import LoadCancelled, WeightStore

log = structlog.get_logger(__name__)

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_GRACE_SECONDS = 1.0


class WeightStoreServicer(weightstore_pb2_grpc.WeightStoreServicer):
    """Serves the manifest of a loaded store; answers UNAVAILABLE while loading."""

    def __init__(self, store: WeightStore | None = None) -> None:
        self._manifest_pb: weightstore_pb2.Manifest | None = None
        if store is not None:
            self.set_store(store)

    def set_store(self, store: WeightStore) -> None:
        """Mark the store loaded; the manifest is converted once here, not per call."""
        self._manifest_pb = store.manifest.to_pb()

    async def GetManifest(self, request, context) -> weightstore_pb2.Manifest:
        """Returns the manifest of the loaded checkpoint."""
        if self._manifest_pb is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "checkpoint is still loading")
        return self._manifest_pb

    async def Health(self, request, context) -> weightstore_pb2.HealthResponse:
        """Liveness and readiness of the store."""
        return weightstore_pb2.HealthResponse(ready=self._manifest_pb is not None, pid=os.getpid())


async def serve(
    model_dir: Path,
    host: str = "127.0.0.1",
    port: int = 0,
    on_ready: Callable[[int], None] | None = None,
    tls: TLSConfig | None = None,
) -> None:
    """Load `model_dir` into shared memory and serve its manifest until cancelled or SIGTERM/SIGINT.

    The server listens (Health: ready=false) while the checkpoint loads, so probes see a live
    process; on_ready(bound_port) runs once every segment is filled. Segments are unlinked on exit.
    """
    cleanup_stale_segments()  # segments of a predecessor killed with SIGKILL
    stop = asyncio.Event()
    cancel_load = threading.Event()  # checked by the loading thread between tensors
    restore_signals = _install_signal_handlers(stop, cancel_load)
    try:
        servicer = WeightStoreServicer()
        server = new_server()
        weightstore_pb2_grpc.add_WeightStoreServicer_to_server(servicer, server)
        bound_port = listen(server, host, port, "weight store", tls)
        await server.start()
        store: WeightStore | None = None
        try:
            started = time.perf_counter()
            store = await _load(model_dir, cancel_load)
            if store is None:  # a stop signal arrived while loading
                return
            servicer.set_store(store)
            log.info(
                "weightstore.ready", port=bound_port, tensors=len(store.manifest.tensors),
                bytes=store.manifest.total_bytes, segments=len(store.manifest.segments),
                seconds=round(time.perf_counter() - started, 3),
            )
            if on_ready is not None:
                on_ready(bound_port)
            await stop.wait()
            log.info("weightstore.stopping")
        finally:
            try:
                await server.stop(_GRACE_SECONDS)
            finally:
                if store is not None:
                    store.close()
    finally:
        restore_signals()


async def _load(model_dir: Path, cancel_load: threading.Event) -> WeightStore | None:
    """Load in a worker thread; on cancellation, stop the thread and wait until it cleaned up."""
    task = asyncio.ensure_future(asyncio.to_thread(WeightStore.load, model_dir, cancel_load))
    try:
        return await asyncio.shield(task)
    except LoadCancelled:
        log.info("weightstore.load_cancelled")
        return None
    except asyncio.CancelledError:
        cancel_load.set()
        with contextlib.suppress(Exception):
            (await task).close()  # finished just before the cancel took effect
        raise


def _install_signal_handlers(stop: asyncio.Event, cancel_load: threading.Event) -> Callable[[], None]:
    """SIGTERM/SIGINT stop the server gracefully; returns a function that restores the old handlers."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None  # only the main thread may own signals; the caller handles them
    loop = asyncio.get_running_loop()
    previous = {sig: signal.getsignal(sig) for sig in _STOP_SIGNALS}

    def on_signal(sig: signal.Signals) -> None:
        log.info("weightstore.signal", signal=sig.name)
        cancel_load.set()
        stop.set()

    for sig in _STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)

    def restore() -> None:
        for sig, handler in previous.items():
            loop.remove_signal_handler(sig)
            signal.signal(sig, handler)

    return restore
