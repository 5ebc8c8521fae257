"""Where two runs of the same greedy requests part, and by how little the model chose (issue 39): bench/gpu.py
reports this when the router's async and waiting modes give different tokens, instead of stopping.

divergence(a, b): how many sequences differ and where each first does (a pure function).
first_token_margins(model_dir, prompts, a, b, ...): at each first differing position, the top-1 minus top-2 logit
of transformers' forward pass over the common prefix, in the run's dtype and in float32: a margin near zero there
(a near-tie that reduction order can flip) is batch variance; a large one points at a defect (a wrong input token,
a stale KV block).
"""

from __future__ import annotations

from pathlib import Path


def divergence(a: list[list[int]], b: list[list[int]]) -> dict:
    """Sequences that differ between two runs of the same requests, and the first position each differs at (in
    generated tokens; a shorter sequence that is a prefix of the other differs where it ends)."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} sequences against {len(b)}")
    first: dict[int, int] = {}
    for index, (x, y) in enumerate(zip(a, b)):
        if x == y:
            continue
        first[index] = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
    positions = sorted(first.values())
    return dict(num_sequences=len(a), sequences_differing=len(first), first_positions=first,
                earliest=positions[0] if positions else None,
                median=positions[len(positions) // 2] if positions else None)


def first_token_margins(model_dir: Path, prompts: list[list[int]], a: list[list[int]], b: list[list[int]],
                        first_positions: dict[int, int], limit: int = 8, device: str = "cuda",
                        dtypes: tuple[str, ...] = ("bfloat16", "float32")) -> list[dict]:
    """For up to `limit` differing sequences: both runs' tokens at the first differing position and transformers'
    top-1 minus top-2 logit there, given the prompt and the common prefix, per dtype (and whether that dtype's argmax
    is one of the two tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    chosen = sorted(first_positions.items())[:limit]
    rows = [dict(sequence=index, position=position, tokens=(a[index][position] if position < len(a[index]) else None,
                                                           b[index][position] if position < len(b[index]) else None))
            for index, position in chosen]
    for dtype in dtypes:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
        with torch.no_grad():
            for row, (index, position) in zip(rows, chosen):
                ids = torch.tensor([prompts[index] + a[index][:position]], device=device)
                logits = model(ids).logits[0, -1].float()
                top = torch.topk(logits, 2)
                row[f"margin_{dtype}"] = round(float(top.values[0] - top.values[1]), 5)
                row[f"argmax_{dtype}"] = int(top.indices[0])
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def serve_both_ways(model_dir: Path, prompts: list[list[int]], new_tokens: int, dtype: str, numerics: str,
                    device: str = "cpu", gpus: tuple[int, ...] | None = None) -> dict:
    """The same greedy requests served concurrently through the router's engine over one worker (tp1pp1), first
    with async scheduling, then with the router waiting for each step's tokens: the two runs' tokens, decode tok/s
    each way, and where they part (divergence). The two modes batch the same requests differently (a step ahead
    carries the decodes one step before the new arrivals join), so with fast numerics in bf16 they may part by
    batch variance alone; with invariant numerics any difference is a defect of one of the paths."""
    import asyncio

    from services.launch.cluster import ClusterConfig, LocalCluster
    from services.router.contracts import GenerationRequest
    from services.router.main import RouterConfig, build_engine

    async def serve(addresses: tuple[str, ...], ahead: bool) -> tuple[list[list[int]], float]:
        import time

        engine = await build_engine(RouterConfig(worker_addresses=addresses, model_dir=str(model_dir),
                                                 model_name="divergence", max_num_seqs=max(256, len(prompts)),
                                                 async_scheduling=ahead))
        outputs: list[list[int]] = [[] for _ in prompts]

        async def consume(index: int) -> None:
            request = GenerationRequest(f"{ahead}-{index}", tuple(prompts[index]), new_tokens)
            async for delta in engine.generate(request):
                outputs[index].extend(delta.token_ids)

        try:
            began = time.perf_counter()
            await asyncio.gather(*(consume(i) for i in range(len(prompts))))
            return outputs, len(prompts) * new_tokens / (time.perf_counter() - began)
        finally:
            await engine.stop()

    config = ClusterConfig(model=str(model_dir), num_workers=1, topology="tp1pp1", device=device, gpus=gpus,
                           dtype=dtype, numerics=numerics, kv_cache_bytes=(2 << 30) if device == "cuda" else 64 << 20,
                           block_size=16, env={"RECONFIG_LOG_LEVEL": "WARNING"})
    with LocalCluster(config) as cluster:
        addresses = tuple(cluster.worker_addresses)
        asyncio.run(serve(addresses, True))  # warm-up
        ahead, ahead_tok_s = asyncio.run(serve(addresses, True))
        waiting, waiting_tok_s = asyncio.run(serve(addresses, False))
    return dict(dtype=dtype, numerics=numerics, device=device, batch=len(prompts), ahead_tok_s=ahead_tok_s,
                waiting_tok_s=waiting_tok_s, divergence=divergence(ahead, waiting), ahead=ahead, waiting=waiting)
