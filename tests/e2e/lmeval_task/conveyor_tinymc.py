"""The data of the `conveyor_tinymc` lm-eval task: a JSONL file next to this module, loaded by absolute
path so that the task runs from any working directory and without a model hub (HF_DATASETS_OFFLINE=1)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets

DATA = Path(__file__).resolve().parent / "conveyor_tinymc.jsonl"


def load(**_: Any) -> datasets.DatasetDict:
    """`custom_dataset` hook: lm-eval passes the task's metadata and dataset_kwargs, none of which matter here."""
    return datasets.load_dataset("json", data_files={"test": str(DATA)})
