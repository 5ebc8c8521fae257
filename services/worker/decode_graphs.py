"""Decode steps replayed as CUDA graphs over the paged KV cache.

A decode step of a small batch is bound by kernel launches and host work, not by the GPU: eagerly, every layer
launches tens of kernels, each ~10 us to issue. Here the whole step of one worker (embedding or received hidden
states, every local layer with its paged attention, final norm, lm_head and greedy argmax) is captured once per
shape and replayed with one launch. Shapes are fixed per graph: the batch is padded up to a bucket, and every row
attends to a fixed number of keys (a power-of-two bucket of KV blocks, masked past its context), so the attention
metadata is computed on the device from four small input tensors (AttentionMetadata.padded_decode) that one
host-to-device copy fills per step. Padding rows repeat row 0 (token, position, block table) and write their
keys/values from row 0's (write_rows), so a duplicate slot receives equal bytes.

Graphs are captured lazily, the first time a (batch bucket, key bucket) is met, or ahead of serving (warm); the
ranks of a stage meet the same steps, so they capture in the same order (a TP collective inside a graph is an
NCCL kernel). They are tied to this runner's weights and KV tensors: a switch builds a new runner and new graphs,
and a KV layer replaced under a runner drops them. A staged switch captures its target's graphs ahead, on the
stage thread while the live runner serves, over the KV tensors the target's pool will hold (`warm(layers=...)`):
captures are thread-local and one at a time per process (`_CAPTURING`). `capture=False` runs the same fixed-shape
step eagerly: what the CPU tests check against the variable-shape path.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import structlog
import torch

from services.contracts.step import SequenceStep
from services.model.attention import AttentionMetadata
from services.model.llama import ShardedCausalLM
from services.model.device_io import staged, to_device
from services.worker.kv_cache import KVCache

log = structlog.get_logger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
MIN_KEYS = 128  # the smallest key bucket (tokens); buckets double from here
# Captured when a layout starts serving (the rest on first use): the batch buckets most steps meet.
WARM_BATCHES = (1, 2, 4, 8, 16, 32, 64)
# One capture at a time in a process: torch captures on one shared side stream, and a staged runner's graphs are
# captured on the stage thread while the live runner may meet a new bucket on the model thread.
_CAPTURING = threading.Lock()


def batch_bucket(batch: int) -> int | None:
    """The smallest bucket holding `batch` rows; None past the largest."""
    return next((b for b in BATCH_BUCKETS if b >= batch), None)


def key_blocks(context_len: int, block_size: int) -> int:
    """KV blocks every row of a graph attends to: a power-of-two number of keys >= MIN_KEYS and >= context_len."""
    keys = MIN_KEYS
    while keys < context_len:
        keys *= 2
    return -(-keys // block_size)


@dataclass
class _Graph:
    """One captured shape: its static inputs, its outputs, and the graph (None: run eagerly)."""

    batch: int
    num_blocks: int
    packed: torch.Tensor            # [batch * (4 + num_blocks)] int64: token, position, context, write row, table
    hidden_in: torch.Tensor | None  # [batch, hidden] (a stage after the first)
    hidden: torch.Tensor | None = None   # [batch, hidden] outputs
    logits: torch.Tensor | None = None   # [batch, vocab] float32 (last stage)
    greedy: torch.Tensor | None = None   # [batch] int64 argmax (last stage)
    graph: torch.cuda.CUDAGraph | None = None

    def fields(self) -> tuple[torch.Tensor, ...]:
        b = self.batch
        tokens, positions, context_lens, write_rows = (self.packed[i * b:(i + 1) * b] for i in range(4))
        return tokens, positions, context_lens, write_rows, self.packed[4 * b:].view(b, self.num_blocks)


@dataclass(frozen=True, slots=True)
class DecodeResult:
    hidden: torch.Tensor               # [B, hidden] (views of the graph's outputs: valid until its next replay)
    logits: torch.Tensor | None        # [B, vocab] float32, last stage
    greedy: torch.Tensor | None        # [B] int64, last stage


class DecodeGraphs:
    """The decode graphs of one ModelRunner (its model shard and KV cache); used from one thread at a time: the
    model thread's, or the stage thread's before a staged runner goes live."""

    def __init__(self, model: ShardedCausalLM, kv_cache: KVCache, device: torch.device, capture: bool,
                 max_batch: int = BATCH_BUCKETS[-1], max_keys: int | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.capture = capture
        self.max_batch = max_batch
        self.max_keys = max_keys
        self.first_stage = model.embed is not None
        self.last_stage = model.lm_head is not None
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._kv_ptrs: tuple[int, ...] | None = None  # the KV tensors the graphs write (a switch fills them later)
        self._kv_layers: list[torch.Tensor] = []
        self.capture_seconds = 0.0

    def accepts(self, seqs: tuple[SequenceStep, ...] | list[SequenceStep]) -> bool:
        """Whether this step is a plain decode step a graph can run: one new token per sequence, no prompt
        logprobs, a batch and contexts within the bounds."""
        if not seqs or len(seqs) > self.max_batch:
            return False
        if any(len(s.token_ids) != 1 or s.prompt_logprob_token_ids for s in seqs):
            return False
        longest = max(s.start_position + 1 for s in seqs)
        return self.max_keys is None or longest <= self.max_keys

    def run(self, seqs: tuple[SequenceStep, ...] | list[SequenceStep], hidden: torch.Tensor | None,
            feed: tuple[list[int], torch.Tensor] | None = None) -> DecodeResult:
        """One decode step of `seqs` (hidden: the received states [B, hidden] on stages after the first; feed: the
        rows fed PENDING_TOKEN and their tokens, on the device). Nothing here waits for the device."""
        self._check_kv()
        block_size = self.kv_cache.block_size
        rows = len(seqs)
        batch = batch_bucket(rows)
        num_blocks = key_blocks(max(s.start_position + 1 for s in seqs), block_size)
        graph = self._graphs.get((batch, num_blocks))
        if graph is None:
            graph = self._graphs[(batch, num_blocks)] = self._new(batch, num_blocks)
        graph.packed.copy_(staged(self._packed(seqs, batch, num_blocks), self.device), non_blocking=True)
        if feed is not None:
            fed, tokens = feed
            graph.fields()[0].index_copy_(0, to_device(fed, self.device), tokens)
        if graph.hidden_in is not None:
            graph.hidden_in[:rows].copy_(hidden)
            if batch > rows:
                graph.hidden_in[rows:].copy_(hidden[:1].expand(batch - rows, -1))
        if graph.graph is not None:
            graph.graph.replay()
        else:
            self._outputs(graph, self._step(graph))
        return DecodeResult(graph.hidden[:rows],
                            graph.logits[:rows] if graph.logits is not None else None,
                            graph.greedy[:rows] if graph.greedy is not None else None)

    def warm(self, batches: tuple[int, ...] = BATCH_BUCKETS, context_len: int = MIN_KEYS,
             layers: list[torch.Tensor] | None = None) -> int:
        """Capture the graphs of these batch buckets at the smallest key bucket ahead of serving; returns how many
        were captured (the ranks of a stage must warm the same list). layers: the KV tensors the cache will hold
        when the graphs first run (default: what it holds now)."""
        self._check_kv(layers)
        num_blocks = key_blocks(context_len, self.kv_cache.block_size)
        captured = 0
        for batch in batches:
            if batch <= self.max_batch and (batch, num_blocks) not in self._graphs:
                self._graphs[(batch, num_blocks)] = self._new(batch, num_blocks)
                captured += 1
        return captured

    def clear(self) -> None:
        """Drop every graph. The next capture takes a new memory pool: the caching allocator keeps a pool whose graphs
        are all gone (until its blocks are freed) but refuses captures into it (found on an H200: INTERNAL ASSERT
        use_count > 0, after a rolled-back switch replaced a KV layer under the live runner)."""
        self._graphs.clear()
        if self.capture:
            self._pool = torch.cuda.graph_pool_handle()

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    # ---- building ------------------------------------------------------------------------------------------------
    def _check_kv(self, layers: list[torch.Tensor] | None = None) -> None:
        """Drop every graph if a KV layer tensor was replaced since they were captured (they would write freed
        memory). Checked before each use, not at construction: a switch builds the runner before its KV arrives."""
        self._kv_layers = layers if layers is not None else self.kv_cache.layers
        pointers = tuple(t.data_ptr() for t in self._kv_layers)
        if pointers != self._kv_ptrs:
            self.clear()
            self._kv_ptrs = pointers

    def _packed(self, seqs, batch: int, num_blocks: int) -> torch.Tensor:
        """The step's inputs, padded to `batch` rows with copies of row 0, as one host int64 tensor (a pending
        token as 0: the feed replaces it; padding rows' tokens are never read back, nor their keys written)."""
        pad = batch - len(seqs)
        tokens = [max(s.token_ids[0], 0) for s in seqs]
        tokens += [tokens[0]] * pad
        positions = [s.start_position for s in seqs]
        positions += [positions[0]] * pad
        context_lens = [p + 1 for p in positions]
        write_rows = list(range(len(seqs))) + [0] * pad
        tables = []
        for s in seqs:
            table = list(s.block_table[:num_blocks])
            tables += table + [table[0]] * (num_blocks - len(table))
        tables += tables[:num_blocks] * pad
        return torch.tensor(tokens + positions + context_lens + write_rows + tables, dtype=torch.int64)

    def _new(self, batch: int, num_blocks: int) -> _Graph:
        packed = torch.zeros(batch * (4 + num_blocks), dtype=torch.int64, device=self.device)
        hidden_in = None
        if not self.first_stage:
            hidden_in = torch.zeros((batch, self.model.spec.hidden_size), dtype=self.model.dtype, device=self.device)
        graph = _Graph(batch, num_blocks, packed, hidden_in)
        if self.capture:
            self._capture(graph)
        return graph

    def _capture(self, graph: _Graph) -> None:
        """Warm up on scratch KV (the real cache holds live requests; zeroed inputs address block 0), then capture
        over the real cache: a capture records kernels without running them."""
        started = time.perf_counter()
        scratch = [torch.zeros_like(cache[:, :1]) for cache in self._kv_layers]
        with _CAPTURING, torch.cuda.device(self.device):
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._step(graph, scratch)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph.graph = torch.cuda.CUDAGraph()
            # thread_local: other threads use CUDA meanwhile (the worker's RPC threads; the model thread's steps when
            # a staged runner captures on the stage thread)
            with torch.cuda.graph(graph.graph, pool=self._pool, capture_error_mode="thread_local"):
                outputs = self._step(graph)
        self._outputs(graph, outputs)
        elapsed = time.perf_counter() - started
        self.capture_seconds += elapsed
        log.info("worker.decode_graph_captured", batch=graph.batch, keys=graph.num_blocks * self.kv_cache.block_size,
                 seconds=round(elapsed, 4), graphs=len(self._graphs) + 1)

    def _step(self, graph: _Graph, caches: list[torch.Tensor] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The fixed-shape step: device work only, no host synchronisation."""
        tokens, positions, context_lens, write_rows, tables = graph.fields()
        meta = AttentionMetadata.padded_decode(positions, tables, context_lens, write_rows, self.kv_cache.block_size,
                                               key_mask=self.model.kernels.decode_attention is None)
        inputs = tokens if graph.hidden_in is None else graph.hidden_in
        hidden = self.model.forward(inputs, positions, caches if caches is not None else self._kv_layers, meta)
        if not self.last_stage:
            return hidden, None, None
        logits = self.model.compute_logits(hidden)
        return hidden, logits, logits.max(dim=-1).indices

    @staticmethod
    def _outputs(graph: _Graph, outputs) -> None:
        graph.hidden, graph.logits, graph.greedy = outputs
