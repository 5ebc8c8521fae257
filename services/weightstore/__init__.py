"""Weightstore: one checkpoint in POSIX shared memory, and a gRPC manifest of where each tensor lives."""

from services.weightstore.manifest import Manifest, SegmentInfo, TensorEntry
from services.weightstore.store import CheckpointError, WeightStore

__all__ = [
    "CheckpointError",
    "Manifest",
    "MappedCheckpoint",
    "SegmentInfo",
    "TensorEntry",
    "WeightStore",
    "fetch_manifest",
]


def __getattr__(name: str):
    # The client needs torch; the store process does not, so it is imported only when asked for.
    if name in ("MappedCheckpoint", "fetch_manifest"):
        from services.weightstore import client

        return getattr(client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
