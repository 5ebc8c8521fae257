"""The instances behind the front router: one gRPC client per instance router, and the wire form of a request.

An instance is today's stack minus the HTTP front: its own workers, layout, controller and KV pool, served by its
router's gRPC (Generate for requests, MigrateOut / MigrateIn for live moves, Stats). The front router talks to
instances only through this, so an instance on another host is the same as one on loopback.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from services.router.contracts import GenerationRequest
from services.rpc.auth import auth_metadata
from services.rpc.reconfig.v1 import router_pb2, router_pb2_grpc
from services.rpc.tls import TLSConfig, aio_channel

_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


def free_name(taken) -> str:
    """The first instance name i0, i1, ... not in `taken`."""
    return next(f"i{n}" for n in range(len(taken) + 1) if f"i{n}" not in taken)


@dataclass(eq=False)
class Instance:
    """One instance router, as the front router sees it."""

    name: str
    address: str                      # the instance router's gRPC host:port
    token: str | None = None          # the control-plane token (MigrateOut / MigrateIn / a migrated Generate)
    capacity_tokens: int = 0          # KV tokens it holds (blocks x block size), from Stats
    block_size: int = 0
    topology: str = ""
    is_up: bool = True                # false once a call found it gone (it gets no new request)
    is_drained: bool = False          # an operator took it out of service (reconfigctl instances drain)
    channel: grpc.aio.Channel | None = field(default=None, repr=False)
    stub: router_pb2_grpc.RouterStub | None = field(default=None, repr=False)
    tls: TLSConfig | None = field(default=None, repr=False)  # mutual TLS to its router (None: plaintext)

    @property
    def in_service(self) -> bool:
        """Whether it may take new requests."""
        return self.is_up and not self.is_drained

    @property
    def metadata(self) -> tuple:
        return auth_metadata(self.token) if self.token else ()

    async def connect(self, timeout_s: float = 30.0) -> router_pb2.RouterStats:
        """Open the channel and read the instance's capacity and layout (waits for it to answer while it is up);
        returns the Stats they came from."""
        self.open()
        return await self.refresh(timeout_s)

    def open(self) -> None:
        """Open the channel (nothing is sent yet)."""
        self.channel = aio_channel(self.address, self.tls, _CHANNEL_OPTIONS, carries_token=bool(self.token))
        self.stub = router_pb2_grpc.RouterStub(self.channel)

    async def refresh(self, timeout_s: float = 10.0) -> router_pb2.RouterStats:
        """Stats, and the capacity and layout they give (a switch changes both)."""
        stats = await self.stub.Stats(router_pb2.StatsRequest(), timeout=timeout_s, metadata=self.metadata,
                                      wait_for_ready=self.is_up)
        self.topology = stats.topology
        if stats.block_size:
            self.block_size = stats.block_size
        self.capacity_tokens = stats.num_kv_blocks_total * (self.block_size or 1)
        return stats

    def generate(self, request: router_pb2.GenerateRequest):
        """A Generate call (a stream of GenerateResponse); cancel() it to abort the request there."""
        return self.stub.Generate(request, metadata=self.metadata)

    async def migrate_out(self, request_id: str, action: int, timeout_s: float = 30.0
                          ) -> router_pb2.MigrateOutResponse:
        return await self.stub.MigrateOut(router_pb2.MigrateOutRequest(request_id=request_id, action=action,
                                                                       timeout_seconds=timeout_s),
                                          timeout=timeout_s + 5, metadata=self.metadata)

    async def migrate_in(self, request: router_pb2.MigrateInRequest, timeout_s: float = 60.0
                         ) -> router_pb2.MigrateInResponse:
        return await self.stub.MigrateIn(request, timeout=timeout_s, metadata=self.metadata)

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()


def request_to_pb(request: GenerationRequest, prompt_token_ids: tuple[int, ...] | None = None,
                  max_tokens: int | None = None) -> router_pb2.GenerateRequest:
    """What an instance runs for `request`: token ids, sampling, stop tokens (EOS resolved here: ignore_eos), no
    stop strings (the front router applies them to the text it decodes). A re-placed request passes its prompt
    plus what it generated, and what is left of max_tokens."""
    return router_pb2.GenerateRequest(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids if prompt_token_ids is None else prompt_token_ids,
        sampling=request.sampling.to_pb(), max_tokens=request.max_tokens if max_tokens is None else max_tokens,
        stop_token_ids=sorted(request.stop_token_ids), ignore_eos=True, min_tokens=request.min_tokens,
    )
