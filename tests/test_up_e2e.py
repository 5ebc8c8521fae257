"""End to end: `reconfig up` (4 CPU workers, TP2PP2) served to the official openai client equals transformers."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import urllib.request

import pytest

from tests.conftest import hf_greedy, make_checkpoint, wait_until
from tests.up_stack import launch_up, openai_client, stop_up, tokenizer_of, wait_for_exit

pytestmark = pytest.mark.multiprocess
NUM_TOKENS = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("e2e") / "llama-e2e", "llama", seed=7)


@pytest.fixture(scope="module")
def stack(checkpoint, tmp_path_factory):
    """A running `reconfig up` process and its stack file."""
    process, info, env = launch_up(
        ["--model", str(checkpoint), "--workers", "4", "--topology", "tp2pp2", "--http-port", "0", "--grpc-port", "0",
         "--controller-port", "0", "--controller-metrics-port", "0", "--kv-cache-mb", "4", "--block-size", "4"],
        tmp_path_factory.mktemp("run"))
    yield process, info, env
    stop_up(process)


def test_completions_equal_transformers(stack, checkpoint):
    _, info, _ = stack
    client = openai_client(info)
    tokenizer = tokenizer_of(checkpoint)
    prompt = [1, 17, 40, 2, 99, 64]
    expected, _ = hf_greedy(checkpoint, [prompt], NUM_TOKENS)
    expected_text = tokenizer.decode(expected[0])
    model = client.models.list().data[0].id
    response = client.completions.create(model=model, prompt=prompt, max_tokens=NUM_TOKENS, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert response.choices[0].text == expected_text
    assert response.usage.completion_tokens == NUM_TOKENS and response.usage.prompt_tokens == len(prompt)
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=NUM_TOKENS, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected_text


def test_chat_equals_transformers(stack, checkpoint):
    import transformers

    _, info, _ = stack
    client = openai_client(info)
    messages = [{"role": "user", "content": "Hi there"}]
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    prompt = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt)
    expected, _ = hf_greedy(checkpoint, [prompt], NUM_TOKENS)
    expected_text = tokenizer_of(checkpoint).decode(expected[0])
    model = client.models.list().data[0].id
    response = client.chat.completions.create(model=model, messages=messages, max_tokens=NUM_TOKENS,
                                              temperature=0, extra_body={"ignore_eos": True})
    assert response.choices[0].message.content == expected_text
    assert response.usage.prompt_tokens == len(prompt)
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=NUM_TOKENS, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected_text


def test_32_concurrent_streams_are_all_correct(stack, checkpoint):
    import openai

    _, info, _ = stack
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 160) for _ in range(rng.randrange(1, 40))] for _ in range(32)]
    lengths = [rng.randrange(1, 24) for _ in prompts]
    expected, _ = hf_greedy(checkpoint, prompts, max(lengths))
    tokenizer = tokenizer_of(checkpoint)

    model = openai_client(info).models.list().data[0].id

    async def one(client, prompt, max_tokens):
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def run_all():
        async with openai_client(info, openai.AsyncOpenAI) as client:
            return await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, lengths)))

    texts = asyncio.run(run_all())
    for i, text in enumerate(texts):
        assert text == tokenizer.decode(expected[i][: lengths[i]]), f"request {i}"


def test_reconfigctl_status_table_and_json(stack):
    _, info, env = stack
    result = subprocess.run([sys.executable, "-m", "services.ctl", "status", "--json"], env=env,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert status["topology"] == "tp2pp2"
    assert len(status["workers"]) == 4
    table = subprocess.run([sys.executable, "-m", "services.ctl", "status"], env=env,
                           capture_output=True, text=True, timeout=30)
    assert table.returncode == 0 and "tp2pp2" in table.stdout


def test_sigterm_stops_everything(stack):
    process, info, _ = stack
    pids = list(info["pids"].values())
    process.send_signal(signal.SIGTERM)
    assert process.wait(30) == 0
    # Children exit on their own once the launcher is gone.
    wait_for_exit([pid for pid in pids if pid != process.pid], what="the launcher's children to exit (no orphan)")


def test_two_api_servers_serve_what_one_does_and_one_lost_is_replaced(checkpoint, tmp_path):
    """`--api-servers 2`: the kernel spreads the connections over both; 16 concurrent greedy streams equal
    transformers; /metrics counts every server's requests; an API server killed with -9 is started again while the
    other serves on, and the stack stops cleanly."""
    import openai

    process, info, _ = launch_up(
        ["--model", str(checkpoint), "--workers", "1", "--topology", "tp1pp1", "--http-port", "0", "--grpc-port",
         "0", "--controller-port", "0", "--controller-metrics-port", "0", "--kv-cache-mb", "4", "--block-size", "4",
         "--api-servers", "2"], tmp_path / "run")
    try:
        assert {"api-0", "api-1", "router"} <= set(info["pids"])
        rng = random.Random(1)
        prompts = [[rng.randrange(3, 160) for _ in range(rng.randrange(1, 30))] for _ in range(16)]
        expected, _ = hf_greedy(checkpoint, prompts, NUM_TOKENS)
        tokenizer = tokenizer_of(checkpoint)
        model = openai_client(info).models.list().data[0].id

        async def one(prompt):
            # A connection of its own: spread by the kernel.
            async with openai_client(info, openai.AsyncOpenAI) as client:
                stream = await client.completions.create(model=model, prompt=prompt, max_tokens=NUM_TOKENS,
                                                         temperature=0, stream=True, extra_body={"ignore_eos": True})
                return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

        async def all_of(batch):
            return await asyncio.gather(*(one(p) for p in batch))

        assert asyncio.run(all_of(prompts)) == [tokenizer.decode(e) for e in expected]
        os.kill(info["pids"]["api-1"], signal.SIGKILL)
        assert asyncio.run(all_of(prompts[:4])) == [tokenizer.decode(e) for e in expected[:4]]

        def finished() -> float:
            with urllib.request.urlopen(f"{info['router_http_address']}/metrics", timeout=10) as response:
                lines = response.read().decode().splitlines()
            return sum(float(line.rpartition(" ")[2]) for line in lines
                       if line.startswith("reconfig:request_success_total"))

        # Each server reports its latencies within a second; the killed server's report may be lost with it: the
        # survivor's and the new one's.
        wait_until(lambda: finished() >= 4, 30, what="4 requests counted on /metrics", interval_s=0.2)
    finally:
        stop_up(process)
    assert process.returncode == 0
    stderr = process.stderr.read()
    assert "api.server_lost" in stderr or "api.server_lost" in process.stdout.read()
