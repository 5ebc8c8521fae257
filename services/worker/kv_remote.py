"""KV between hosts for a request's move between instances: the target's worker receives the slices it needs from
each source worker over a torch.distributed group of the two (gloo, on the host network), instead of reading the
source's shared memory or CUDA IPC handles, which only its own host can.

The receiver (ImportKV, services/worker/kv_import.py) hosts a TCPStore for the move, asks each source worker it
reads from to ExportKV its slices (its gRPC link: mutual TLS and the token, as every other), and joins a two-rank
ProcessGroupGloo with it under a key of its own in that store: the source is rank 1 and sends each (layer, KV head
range) of the blocks, packed in ascending block order, with the slice's index as the tag. The store and the group
carry tensors unauthenticated and in clear, as the instance's own groups do: a network the operator trusts.
"""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from services.rpc.auth import auth_metadata
from services.rpc.reconfig.v1 import worker_pb2, worker_pb2_grpc
from services.rpc.tls import TLSConfig, sync_channel
from services.runtime.host import address_host
from services.topology import KVMigrationPlan, KVTransfer
from services.worker.channel import Source
from services.worker.kv_cache import KVCache

SENDER, RECEIVER = 1, 0


def export_kv(cache: KVCache, request: worker_pb2.ExportKVRequest) -> worker_pb2.ExportKVResponse:
    """The source's side: join the receiver's group and send every slice of the blocks (ValueError on a layer this
    worker does not hold or a block outside its pool; RuntimeError when the group cannot be joined)."""
    started = time.perf_counter()
    ids = list(request.block_ids)
    if ids != sorted(set(ids)):
        raise ValueError("block ids must be ascending and distinct")
    if bad := [b for b in ids if not 0 <= b < cache.num_blocks]:
        raise ValueError(f"block ids {bad[:4]} are outside this pool of {cache.num_blocks} blocks")
    if missing := sorted({s.layer for s in request.slices if not cache.has_layer(s.layer)}):
        raise ValueError(f"this worker holds no KV of layers {missing}")
    timeout = timedelta(seconds=request.timeout_seconds or 60.0)
    port = request.store_address.rpartition(":")[2]
    if not port.isdigit():
        raise ValueError(f"store_address must be host:port, not {request.store_address!r}")
    store = dist.TCPStore(address_host(request.store_address), int(port), is_master=False, timeout=timeout)
    group = dist.ProcessGroupGloo(dist.PrefixStore(request.group_key, store), SENDER, 2, timeout)
    index = torch.tensor(ids, dtype=torch.int64)
    sent = 0
    for tag, piece in enumerate(request.slices):
        tensor = cache.layer(piece.layer).tensor
        part = tensor[:, index.to(tensor.device), :, piece.head_offset:piece.head_offset + piece.num_heads]
        part = part.cpu().contiguous()  # gloo's send takes host tensors
        group.send([part], RECEIVER, tag).wait()
        sent += part.numel() * part.element_size()
    return worker_pb2.ExportKVResponse(kv_bytes_sent=sent, seconds=time.perf_counter() - started)


class RemoteKVChannel:
    """The receiver's side, as a KV channel over one import: at start it asks every source worker of the plan for
    the slices this rank needs and posts their receives; `exchange` hands a layer's slices out once they are in."""

    needs_outgoing = False

    def __init__(self, plan: KVMigrationPlan, rank: int, addresses: dict[int, str], block_ids: Sequence[int],
                 cache: KVCache, bind_host: str, token: str | None, tls: TLSConfig | None,
                 timeout_s: float = 60.0) -> None:
        """`addresses`: plan rank of each source worker -> its gRPC address; `block_ids`: the source's, ascending."""
        self.block_size, self.head_dim, self.dtype = cache.block_size, cache.head_dim, cache.dtype
        self._received: dict[KVTransfer, tuple[torch.Tensor, object]] = {}
        self._calls: list[tuple[str, object]] = []
        self._channels, self._groups = [], []
        timeout = timedelta(seconds=timeout_s)
        wanted: dict[int, list[KVTransfer]] = {}
        for layer in plan.new_local_layers(rank):
            for transfer in plan.for_layer(layer):
                if transfer.dst_rank == rank and not transfer.is_local:
                    wanted.setdefault(transfer.src_rank, []).append(transfer)
        self._store = dist.TCPStore(bind_host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        advertised = bind_host if bind_host not in ("", "0.0.0.0", "::") else socket.getfqdn()
        metadata = auth_metadata(token) if token else None
        try:
            for src_rank, transfers in sorted(wanted.items()):
                if src_rank not in addresses:
                    raise RuntimeError(f"the source names no address for its worker {src_rank}")
                key = f"reconfig/kv-import/{uuid.uuid4().hex}/"
                channel = sync_channel(addresses[src_rank], tls, carries_token=bool(token))
                self._channels.append(channel)
                call = worker_pb2_grpc.WorkerStub(channel).ExportKV.future(worker_pb2.ExportKVRequest(
                    store_address=f"{advertised}:{self._store.port}", group_key=key, block_ids=list(block_ids),
                    slices=[worker_pb2.KVSlice(layer=t.layer, head_offset=t.src_head_offset,
                                               num_heads=t.num_kv_heads) for t in transfers],
                    timeout_seconds=timeout_s), timeout=timeout_s, metadata=metadata)
                self._calls.append((addresses[src_rank], call))
                group = dist.ProcessGroupGloo(dist.PrefixStore(key, self._store), RECEIVER, 2, timeout)
                self._groups.append(group)
                for tag, transfer in enumerate(transfers):
                    buffer = torch.empty((2, len(block_ids), self.block_size, transfer.num_kv_heads, self.head_dim),
                                         dtype=self.dtype)
                    self._received[transfer] = (buffer, group.recv([buffer], SENDER, tag))
        except BaseException:
            self.close()
            raise

    def exchange(self, layer, outgoing, incoming) -> dict[KVTransfer, Source]:
        received = {}
        for transfer in incoming:
            buffer, work = self._received[transfer]
            work.wait()
            received[transfer] = Source(buffer, 0, by_block_id=False)
        return received

    def settle(self) -> None:
        pass  # the slices are this worker's own buffers

    def finish(self) -> None:
        """Raise if a source failed its part (its ExportKV's error)."""
        for address, call in self._calls:
            call.result()  # grpc.RpcError names the source's failure

    def close(self) -> None:
        for call in (call for _, call in self._calls):
            if not call.done():
                call.cancel()
        self._calls.clear()
        self._received.clear()
        self._groups.clear()
        for channel in self._channels:
            channel.close()
        self._channels.clear()
