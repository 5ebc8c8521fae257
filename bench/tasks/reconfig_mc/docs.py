"""The reconfig_mc task's documents, read from the jsonl beside this file (wherever lm-eval is started from)."""

from __future__ import annotations

import json
from pathlib import Path

import datasets


def load(**kwargs) -> dict[str, datasets.Dataset]:
    """lm-eval's custom_dataset hook: the one test split (kwargs are the task's metadata, unused)."""
    lines = (Path(__file__).with_name("reconfig_mc.jsonl")).read_text().splitlines()
    return {"test": datasets.Dataset.from_list([json.loads(line) for line in lines])}
