"""Logprobs across real worker processes equal transformers' log_softmax (fp32, 1e-4) in every topology: prompt
logprobs of a prompt prefilled in two chunks (echo), and the sampled token's logprob with its top alternatives,
next to a request that asks for none in the same batch."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.launch.cluster import ClusterConfig, LocalCluster
from services.router.driver import Driver
from services.contracts.step import GREEDY, SamplingParams, SequenceStep

pytestmark = pytest.mark.multiprocess

PROMPT = [5, 17, 99, 3, 42, 42, 8, 150, 61, 7, 7, 230]  # 12 tokens: 3 KV blocks of 4
OTHER = [9, 8, 7]
CHUNK = 7                   # the prompt is fed as 7 + 5 tokens
NUM_TOP = 5
ATOL = 1e-4
LAYOUTS = [(1, "tp1pp1"), (2, "tp2pp1"), (2, "tp1pp2"), (4, "tp2pp2")]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tests.conftest import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("logprobs") / "llama", "llama", seed=3)


@pytest.fixture(scope="module")
def oracle(checkpoint) -> torch.Tensor:
    """transformers' log_softmax at every position of PROMPT + its greedy next token: [13, vocab]."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        first = model(torch.tensor([PROMPT])).logits[0, -1].argmax().item()
        logits = model(torch.tensor([PROMPT + [first]])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


async def _run(addresses: list[str]):
    wanted = SamplingParams(num_logprobs=NUM_TOP)
    async with Driver(addresses) as driver:
        first = await driver.step([
            SequenceStep("p", tuple(PROMPT[:CHUNK]), 0, (0, 1, 2, 3), wanted, sample=False,
                         prompt_logprob_token_ids=tuple(PROMPT[1:CHUNK + 1])),
            SequenceStep("o", tuple(OTHER), 0, (4,), GREEDY),
        ])
        second = await driver.step([
            SequenceStep("o", ({o.request_id: o for o in first.outputs}["o"].token_id,), 3, (4,), GREEDY,
                         num_generated=1),
            SequenceStep("p", tuple(PROMPT[CHUNK:]), CHUNK, (0, 1, 2, 3), wanted,
                         prompt_logprob_token_ids=tuple(PROMPT[CHUNK + 1:])),
        ])
        sampled = {o.request_id: o for o in second.outputs}["p"]
        third = await driver.step([SequenceStep("p", (sampled.token_id,), len(PROMPT), (0, 1, 2, 3), wanted,
                                                num_generated=1)])
    return first, second, third


def _assert_matches(logprob, reference: torch.Tensor) -> None:
    """A TokenLogprob equals a row of transformers' log_softmax: the token's value and the top NUM_TOP."""
    assert abs(logprob.logprob - reference[logprob.token_id].item()) <= ATOL
    top = torch.topk(reference, NUM_TOP)
    assert [token for token, _ in logprob.top] == top.indices.tolist()
    torch.testing.assert_close(torch.tensor([value for _, value in logprob.top]), top.values, atol=ATOL, rtol=0)


@pytest.mark.parametrize("num_workers,topology", LAYOUTS, ids=[t for _, t in LAYOUTS])
def test_logprobs_match_transformers(checkpoint, oracle, num_workers, topology):
    config = ClusterConfig(model=str(checkpoint), num_workers=num_workers, topology=topology,
                           kv_cache_bytes=1 << 20, block_size=4)
    with LocalCluster(config) as cluster:
        first, second, third = asyncio.run(_run(cluster.worker_addresses))
    by_id = {o.request_id: o for o in first.outputs}
    assert by_id["o"].logprob is None and by_id["o"].prompt_logprobs == ()  # asked for none
    assert by_id["p"].token_id == -1 and by_id["p"].logprob is None  # a chunk that does not sample
    sampled = {o.request_id: o for o in second.outputs}["p"]
    prompt_logprobs = by_id["p"].prompt_logprobs + sampled.prompt_logprobs
    assert [p.token_id for p in prompt_logprobs] == PROMPT[1:]
    for position, logprob in enumerate(prompt_logprobs):  # prompt token position + 1, from position's logits
        _assert_matches(logprob, oracle[position])
    assert sampled.token_id == oracle[len(PROMPT) - 1].argmax().item()
    _assert_matches(sampled.logprob, oracle[len(PROMPT) - 1])
    _assert_matches(third.outputs[0].logprob, oracle[len(PROMPT)])
