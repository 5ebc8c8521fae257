"""Driver: the client side of the workers' step streams (used by tests, benchmarks, the CLI and the router)."""

from __future__ import annotations

import asyncio
import itertools

import grpc
from google.protobuf.message import DecodeError

from services.contracts.step import StepOutput, WorkerTime
from services.contracts.step_rows import RowEncoder
from services.rpc.auth import auth_metadata
from services.rpc.errors import describe_error
from services.rpc.frames import FrameProtocol
from services.rpc.reconfig.v1 import worker_pb2, worker_pb2_grpc
from services.rpc.tls import TLSConfig, aio_channel

_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


class StepError(RuntimeError):
    """A worker reported an error for a step, or a stream broke."""


class WorkerUnreachable(ConnectionError):
    """A worker did not answer when the driver connected (UNAVAILABLE to a gRPC caller)."""


class _StepClient(FrameProtocol):
    """The router's end of one worker's step socket: frames out, and each StepResult frame in resolves the future
    of its step (services.rpc.frames)."""

    def __init__(self, address: str) -> None:
        super().__init__()
        self.address = address
        self.greeting: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.pending: dict[int, asyncio.Future[StepOutput]] = {}
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def frame_received(self, payload: bytes) -> None:
        if not self.greeting.done():
            self.greeting.set_result(payload)
            return
        try:
            output = StepOutput.from_pb(worker_pb2.StepResult.FromString(payload))
        except DecodeError as exc:
            self.abort(StepError(f"worker {self.address} sent a step result that does not parse: {exc}"))
            return
        future = self.pending.pop(output.step_id, None)
        if future is not None and not future.done():
            future.set_result(output)

    def closed(self, error: Exception | None) -> None:
        if isinstance(error, StepError):
            failure = error
        elif error is None:
            failure = StepError(f"worker {self.address} step stream failed: the worker closed it (stopped or died)")
        else:
            failure = StepError(f"worker {self.address} step stream failed: {type(error).__name__}: {error}")
        if not self.greeting.done():
            self.greeting.set_exception(failure)
        for future in self.pending.values():
            if not future.done():
                future.set_exception(failure)
        self.pending.clear()
        if not self.lost.done():
            self.lost.set_result(None)


class _WorkerStream:
    """One worker: its gRPC channel (info, KV pools, imports) and its step socket, whose results resolve the
    futures of the steps in flight."""

    def __init__(self, address: str, metadata: tuple, token: str | None, tls: TLSConfig | None = None) -> None:
        self.address = address
        self.metadata = metadata
        self.token = token
        self.tls = tls
        # carries_token: the token goes over this channel and in the step socket's greeting, to the same host.
        self.channel = aio_channel(address, tls, _CHANNEL_OPTIONS, carries_token=bool(token))
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self.client: _StepClient | None = None

    async def open(self, step_port: int, timeout_s: float = 10.0) -> None:
        """Connect to the worker's step socket (on the host of its gRPC address) and greet it with the token; with
        TLS, the socket is mutual TLS too (the worker's certificate must name its host)."""
        if step_port <= 0:
            raise StepError(f"worker {self.address} reports no step socket (an older worker?)")
        host = self.address.rpartition(":")[0].strip("[]")
        loop = asyncio.get_running_loop()
        client: _StepClient | None = None
        try:
            ssl = {} if self.tls is None else {"ssl": self.tls.client_ssl_context(), "server_hostname": host}
            _, client = await asyncio.wait_for(
                loop.create_connection(lambda: _StepClient(self.address), host, step_port, **ssl), timeout_s)
            client.send((self.token or "").encode())
            refusal = await asyncio.wait_for(client.greeting, timeout_s)
        except (OSError, asyncio.TimeoutError, StepError) as exc:
            if client is not None and client.transport is not None:
                client.transport.close()
            raise WorkerUnreachable(f"worker {self.address}: cannot open its step socket {host}:{step_port}: "
                                    f"{type(exc).__name__}: {exc}") from None
        if refusal:
            client.transport.close()
            raise StepError(f"worker {self.address} refused the step stream: {refusal.decode(errors='replace')}")
        self.client = client

    @property
    def is_open(self) -> bool:
        """The step socket is open (it has not broken)."""
        return self.client is not None and not self.client.is_closed

    def expect(self, step_id: int) -> asyncio.Future[StepOutput]:
        """The future of a step's result; fails at once if the stream is gone."""
        future = asyncio.get_running_loop().create_future()
        if self.client is None or self.client.is_closed:
            future.set_exception(StepError(f"worker {self.address}'s step stream is closed"))
        else:
            self.client.pending[step_id] = future
        return future

    def write(self, payload: bytes) -> None:
        if self.client is not None:
            self.client.send(payload)

    async def close(self) -> None:
        """Wait (up to 5 s) for the steps in flight to answer, then close the socket and the channel."""
        client = self.client
        if client is not None:
            if client.pending:
                await asyncio.wait(list(client.pending.values()), timeout=5)
            if client.transport is not None:
                client.transport.close()
            await asyncio.wait([client.lost], timeout=5)
        await self.channel.close()


def peer_pool(prepared: worker_pb2.PrepareSwitchResponse) -> worker_pb2.PeerPool:
    """A worker's KV pool as others read it (its PrepareSwitch answer: segments, IPC handles, host)."""
    return worker_pb2.PeerPool(kv_segments=prepared.kv_segments, kv_cuda_ipc=prepared.kv_cuda_ipc,
                               hostname=prepared.hostname, cuda_ipc=prepared.cuda_ipc,
                               shm_domain=prepared.shm_domain)


class Driver:
    """Sends each step to every active worker and returns the last stage's outputs."""

    def __init__(self, worker_addresses: list[str], step_timeout_s: float = 120.0, token: str | None = None,
                 tls: TLSConfig | None = None) -> None:
        self.addresses = list(worker_addresses)
        self.step_timeout_s = step_timeout_s
        self.token = token  # the control-plane token, when the workers require it
        self.tls = tls      # mutual TLS to the workers (gRPC and step sockets); None: plaintext
        self.metadata = auth_metadata(token) if token else ()
        self.infos: list[worker_pb2.WorkerInfo] = []
        self._streams: list[_WorkerStream] = []
        self._step_ids = itertools.count(1)
        self._work: dict[int, WorkerTime] = {}  # by rank: how long each worker's part of the steps took
        self.rows = RowEncoder()  # what the workers hold of each request: steps go in the delta form

    async def __aenter__(self) -> Driver:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def connect(self, previous: Driver | None = None,
                      infos: list[worker_pb2.WorkerInfo] | None = None) -> None:
        """Read every worker's info (all at once) and open the step streams of the active ones, each over the
        channel its info came through (a switch's rebind waits on this: no second connection per worker).

        previous: the driver this one replaces (a switch's rebind, nothing in flight): the open streams of its
        workers are shared, not reopened, and step ids go on from its own. It keeps them: close it with
        keep=self.streams once this one is taken, or close this one with keep=previous.streams if not.
        infos: the workers' infos, one per address, as they just answered the switch (not asked again).
        A driver made without TLS takes the previous one's (a rebind reaches the same stack's workers)."""
        if infos is not None and len(infos) != len(self.addresses):
            raise ValueError(f"{len(infos)} worker infos for {len(self.addresses)} addresses")
        if previous is not None and self.tls is None:
            self.tls = previous.tls
        shared = {stream.address: stream for stream in previous._streams if stream.is_open} if previous else {}
        streams = [shared.get(address) or _WorkerStream(address, self.metadata, self.token, self.tls)
                   for address in self.addresses]
        mine = [stream for stream in streams if stream not in shared.values()]
        try:
            if infos is None:
                infos = await asyncio.gather(*(self._info(stream) for stream in streams))
        except BaseException:
            await asyncio.gather(*(stream.channel.close() for stream in mine), return_exceptions=True)
            raise
        self.infos = list(infos)
        self._streams = [stream for stream, info in zip(streams, infos) if info.num_kv_blocks > 0]
        await asyncio.gather(*(stream.channel.close() for stream, info in zip(streams, infos)
                               if info.num_kv_blocks == 0 and stream in mine))
        try:
            await asyncio.gather(*(stream.open(info.step_port) for stream, info in zip(streams, infos)
                                   if info.num_kv_blocks > 0 and stream.client is None))
        except BaseException:
            await asyncio.gather(*(stream.close() for stream in mine), return_exceptions=True)
            raise
        if previous is not None:
            self._step_ids = previous._step_ids

    @property
    def streams(self) -> tuple[_WorkerStream, ...]:
        """The step streams of the active workers, in rank order."""
        return tuple(self._streams)

    async def _info(self, stream: _WorkerStream) -> worker_pb2.WorkerInfo:
        try:
            return await stream.stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=10, metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.UNAUTHENTICATED:
                raise
            raise WorkerUnreachable(f"worker {stream.address} does not answer: {describe_error(exc)}") from None

    @property
    def num_kv_blocks(self) -> int:
        """Usable KV blocks: the smallest capacity over active workers (block ids are shared by all)."""
        return min(i.num_kv_blocks for i in self.infos if i.num_kv_blocks > 0)

    @property
    def dp_size(self) -> int:
        """Data-parallel attention ranks, each with its own KV pool: the EP size of an expert-parallel layout, else
        1 (the router keeps one block accounting per rank)."""
        return max((i.ep_size for i in self.infos if i.num_kv_blocks > 0), default=1) or 1

    @property
    def block_size(self) -> int:
        return next(i.block_size for i in self.infos if i.num_kv_blocks > 0)

    async def submit(self, sequences, commit_expert_map: int = 0) -> asyncio.Future[StepOutput]:
        """Send a step to every active worker now; the returned future resolves with the sampled outputs.
        Several steps may be in flight (pipeline parallelism keeps every stage busy). commit_expert_map: the EPLB
        epoch whose staged expert map every worker installs before this step (0: none)."""
        if closed := [stream.address for stream in self._streams if not stream.is_open]:
            raise StepError(f"the step stream of worker {', '.join(closed)} is closed")
        step_id = next(self._step_ids)
        payload = self.rows.encode(step_id, sequences, commit_expert_map).SerializeToString()
        futures = [stream.expect(step_id) for stream in self._streams]
        # All or nothing: a step written to some workers but not others would leave a PP send/recv or a TP
        # collective unmatched. The writes never suspend, so no cancellation can fall between them (a closed
        # stream drops its write, and its future has already failed: the step fails as a whole).
        for stream in self._streams:
            stream.write(payload)
        return self._gather(step_id, futures)

    async def step(self, sequences) -> StepOutput:
        """Run one step and wait for it; its outputs hold every row's token (the engine reads the packed tokens of
        submit's result instead: StepOutput.sampled)."""
        sequences = list(sequences)
        return (await (await self.submit(sequences))).expanded([s.request_id for s in sequences])

    def _gather(self, step_id: int, futures: list[asyncio.Future[StepOutput]]) -> asyncio.Future[StepOutput]:
        """One future for every worker's answer to a step: it fails with the first stream that fails, or after
        step_timeout_s; callbacks, not a task per step."""
        loop = asyncio.get_running_loop()
        result: asyncio.Future[StepOutput] = loop.create_future()
        remaining = len(futures)

        def fail(error: BaseException) -> None:
            timer.cancel()
            result.set_exception(error)
            for future in futures:
                future.cancel()

        def timed_out() -> None:
            if not result.done():
                fail(StepError(f"step {step_id} timed out after {self.step_timeout_s:.0f}s"))

        def answered(future: asyncio.Future[StepOutput]) -> None:
            nonlocal remaining
            error = StepError(f"step {step_id} was cancelled") if future.cancelled() else future.exception()
            if result.done():
                return
            if error is not None:
                fail(error)
                return
            remaining -= 1
            if remaining == 0:
                timer.cancel()
                try:
                    result.set_result(self._combine(step_id, [f.result() for f in futures]))
                except StepError as exc:
                    result.set_exception(exc)

        timer = loop.call_later(self.step_timeout_s, timed_out)
        for future in futures:
            future.add_done_callback(answered)
        if not futures:
            timer.cancel()
            result.set_exception(StepError(f"step {step_id} has no active worker to run it"))
        return result

    def _combine(self, step_id: int, outputs: list[StepOutput]) -> StepOutput:
        """The step's output from every worker's answer; StepError if any reported one."""
        errors = [f"rank {o.rank}: {o.error}" for o in outputs if o.error]
        if errors:
            raise StepError(f"step {step_id} failed: " + "; ".join(errors))
        for o in outputs:
            if o.forward_seconds > 0:
                was = self._work.get(o.rank) or WorkerTime(o.rank)
                self._work[o.rank] = WorkerTime(o.rank, was.forward_seconds + o.forward_seconds,
                                                was.head_seconds + o.head_seconds, was.steps + 1)
        # The last stage's TP rank 0 carries the tokens; in an EP layout every last-stage rank carries its own (each
        # rank's packed tokens are -1 where it sampled nothing).
        tokens: tuple[int, ...] = ()
        for o in outputs:
            if o.tokens:
                tokens = o.tokens if not tokens else tuple(map(max, tokens, o.tokens))
        return StepOutput(step_id, outputs[0].rank, tuple(o for output in outputs for o in output.outputs),
                          compute_seconds=max(o.compute_seconds for o in outputs), tokens=tokens)

    def layer_partition(self) -> list[int]:
        """Layers per pipeline stage of the live layout, as the active workers hold them."""
        stages = {i.pp_rank: i.layer_end - i.layer_start for i in self.infos if i.num_kv_blocks > 0}
        return [stages[stage] for stage in sorted(stages)]

    async def kv_pools(self) -> dict[int, worker_pb2.PeerPool]:
        """Each active worker's KV pool by rank (layer -> shared-memory segment on CPU, -> CUDA IPC handle on a
        GPU), for another instance on this host to read (live request migration)."""
        topology = self.infos[0].topology if self.infos else ""
        replies = await asyncio.gather(*(stream.stub.PrepareSwitch(
            worker_pb2.PrepareSwitchRequest(topology=topology, export_cuda_ipc=True), timeout=30,
            metadata=self.metadata) for stream in self._streams))
        ranks = [i.rank for i in self.infos if i.num_kv_blocks > 0]
        pools = {rank: peer_pool(reply) for rank, reply in zip(ranks, replies)}
        for rank, stream in zip(ranks, self._streams):
            pools[rank].address = stream.address  # a worker on another host asks it to ExportKV
        return pools

    async def import_kv(self, request: worker_pb2.ImportKVRequest) -> int:
        """Every active worker copies the request's blocks from another instance's pools; the bytes copied."""
        replies = await asyncio.gather(*(stream.stub.ImportKV(request, timeout=self.step_timeout_s,
                                                               metadata=self.metadata)
                                         for stream in self._streams))
        return sum(reply.kv_bytes_received for reply in replies)

    def worker_times(self) -> tuple[WorkerTime, ...]:
        """Each active worker's model work since this driver connected, by rank."""
        return tuple(self._work[rank] for rank in sorted(self._work))

    async def close(self, keep: tuple[_WorkerStream, ...] = ()) -> None:
        """End the step streams and close their channels, except those in `keep` (another driver's now)."""
        streams, self._streams = self._streams, []
        await asyncio.gather(*(stream.close() for stream in streams if stream not in keep))
