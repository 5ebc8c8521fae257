"""`reconfig up` with its defaults (smollm2-135m on 4 CPU workers in TP1PP4) answers a chat as transformers does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.conftest import hf_greedy, wait_for_stack_file
from tests.up_stack import wait_ready

pytestmark = pytest.mark.multiprocess
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 10


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _wait_ready(process: subprocess.Popen, run_dir, deadline: float) -> dict:
    info = json.loads(wait_for_stack_file(process, run_dir, deadline - time.monotonic()).read_text())
    wait_ready(info["router_http_address"], deadline - time.monotonic(), process)
    return info


def test_default_stack_answers_the_chat_as_transformers(smollm2, tmp_path):
    import transformers

    model_dir = smollm2  # in the default cache, where `reconfig up` finds it
    env = {**os.environ, "RECONFIG_RUN_DIR": str(tmp_path / "run")}
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--http-port", "0", "--grpc-port", "0", "--controller-port", "0", "--controller-metrics-port", "0"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        info = _wait_ready(process, tmp_path / "run", time.monotonic() + 180)
        assert (info["model"], info["topology"]) == ("smollm2-135m", "tp1pp4")
        reply = _post(info["router_http_address"] + "/v1/chat/completions",
                      {"model": "smollm2-135m", "messages": QUESTION, "max_tokens": MAX_TOKENS, "temperature": 0})
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=True)
    expected, _ = hf_greedy(model_dir, [prompt["input_ids"]], MAX_TOKENS)
    answer = expected[0][: expected[0].index(tokenizer.eos_token_id) + 1]  # the stack stops at <|im_end|>
    assert reply["usage"] == {"prompt_tokens": len(prompt["input_ids"]), "completion_tokens": len(answer),
                              "total_tokens": len(prompt["input_ids"]) + len(answer)}
    assert reply["choices"][0]["message"]["content"] == tokenizer.decode(answer, skip_special_tokens=True)
    assert reply["choices"][0]["message"]["content"] == "The capital of France is Paris."
    assert reply["choices"][0]["finish_reason"] == "stop"
