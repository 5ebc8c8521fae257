"""`reconfig generate` end to end: JSONL in, JSON out, equal to the transformers oracle; bad input exits 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import hf_greedy, make_checkpoint


def _reconfig(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], capture_output=True, text=True, timeout=180)


@pytest.mark.multiprocess
def test_generate_json_matches_transformers(tmp_path):
    model = make_checkpoint(tmp_path / "llama", "llama", seed=3)
    prompts = [[1, 17, 40, 2, 99], [1, 5]]
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    result = _reconfig("generate", "--model", str(model), "--workers", "2", "--topology", "tp1pp2",
                       "--prompts-file", str(prompts_file), "--max-tokens", "12", "--ignore-eos", "--json")
    assert result.returncode == 0, result.stderr
    outputs = json.loads(result.stdout)["outputs"]
    expected, _ = hf_greedy(model, prompts, 12)
    assert [o["token_ids"] for o in outputs] == expected
    assert all(isinstance(o["text"], str) for o in outputs)


@pytest.mark.parametrize("content,message", [
    ("not json\n", "prompts.jsonl:1: not JSON"),
    ('{"prompt_token_ids": []}\n', "non-empty list"),
    ('{"text": "x"}\n', 'expected {"prompt_token_ids"'),
    ("", "no prompts"),
])
def test_bad_prompts_file(tmp_path, content, message):
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text(content)
    result = _reconfig("generate", "--prompts-file", str(prompts_file))
    assert result.returncode == 2 and message in result.stderr


def test_invalid_topology_is_refused_before_starting(tmp_path):
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text('{"prompt": "hi"}\n')
    result = _reconfig("generate", "--prompts-file", str(prompts_file), "--workers", "2", "--topology", "tp4pp1")
    assert result.returncode == 2
    assert "tp*pp=4 exceeds the 2 available workers" in result.stderr
