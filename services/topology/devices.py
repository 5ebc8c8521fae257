"""Which GPU each worker rank runs on, decided before anything starts.

Every worker is a rank of one torch.distributed world (standbys included), and NCCL refuses two ranks on one GPU
("Duplicate GPU detected", at the first collective, long after start). So a layout that would put two NCCL ranks
on a GPU is refused here, with the reason and the way out; the shared-GPU mode (gloo collectives, for development
and tests) lets several ranks use one GPU on purpose.
"""

from __future__ import annotations

from collections.abc import Sequence


class DevicePlacementError(ValueError):
    """The workers cannot be placed on the GPUs as asked; the message says why and what to change."""


def parse_gpus(spec: str | int | Sequence[int] | None) -> int | tuple[int, ...] | None:
    """`--gpus`: None (every visible GPU), a count ("2": the first two visible), or a list of CUDA ordinals among
    the visible GPUs ("0,1"; one GPU as "3,"). A TOML file may give an int or a list."""
    if spec is None or isinstance(spec, int):
        return spec
    if not isinstance(spec, str):
        return tuple(int(i) for i in spec)
    text = spec.strip()
    try:
        if "," not in text:
            return int(text)
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise DevicePlacementError(f"--gpus takes a count (2) or CUDA ordinals (0,1), not {spec!r}") from None


def assign_gpus(num_workers: int, num_visible: int, gpus: int | tuple[int, ...] | None = None,
                gpu_sharing: bool = False) -> tuple[int, ...]:
    """The CUDA ordinal of each rank: rank i runs on gpus[i % len(gpus)]. Without `gpu_sharing`, each rank needs a
    GPU of its own (NCCL); a placement that would share one is refused (DevicePlacementError)."""
    if num_visible < 1:
        raise DevicePlacementError(
            "--device cuda: no GPU is visible (torch.cuda.device_count() is 0: check the driver and "
            "CUDA_VISIBLE_DEVICES), or run on CPU with --device cpu")
    chosen = _chosen(num_visible, gpus)
    if not gpu_sharing:
        duplicates = sorted({g for g in chosen if chosen.count(g) > 1})
        if duplicates:
            raise DevicePlacementError(
                f"--gpus names GPU {', '.join(map(str, duplicates))} more than once, but NCCL takes one rank per "
                f"GPU; name each GPU once, or add --gpu-sharing to run several workers on one GPU (development)")
        if num_workers > len(chosen):
            raise DevicePlacementError(
                f"{num_workers} workers on {_count(len(chosen))} ({', '.join(map(str, chosen))}) would put "
                f"{_per_gpu(num_workers, len(chosen))} NCCL ranks on one GPU, and NCCL refuses two ranks on one "
                f"device ('Duplicate GPU detected'). Use at most {len(chosen)} worker(s) (--workers "
                f"{len(chosen)} with a topology of that many, e.g. --topology tp{len(chosen)}pp1), give more GPUs "
                f"with --gpus, or add --gpu-sharing to run the workers on shared GPUs (gloo collectives; slower, "
                f"for development)")
    return tuple(chosen[rank % len(chosen)] for rank in range(num_workers))


def _chosen(num_visible: int, gpus: int | tuple[int, ...] | None) -> list[int]:
    """The GPUs the workers may use, as CUDA ordinals (every one checked against the visible count)."""
    if gpus is None:
        return list(range(num_visible))
    if isinstance(gpus, int):
        if not 1 <= gpus <= num_visible:
            raise DevicePlacementError(f"--gpus {gpus}: between 1 and the {_count(num_visible)} visible")
        return list(range(gpus))
    if not gpus:
        raise DevicePlacementError("--gpus names no GPU")
    outside = [g for g in gpus if not 0 <= g < num_visible]
    if outside:
        raise DevicePlacementError(
            f"--gpus {','.join(map(str, gpus))}: no GPU {', '.join(map(str, outside))} among the "
            f"{_count(num_visible)} visible (ordinals 0..{num_visible - 1}, after CUDA_VISIBLE_DEVICES)")
    return list(gpus)


def _count(num_gpus: int) -> str:
    return f"{num_gpus} GPU" if num_gpus == 1 else f"{num_gpus} GPUs"


def _per_gpu(num_workers: int, num_gpus: int) -> int:
    return -(-num_workers // num_gpus)
