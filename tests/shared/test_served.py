"""MODELS: its forms, its errors naming the item at fault, and what a process reads of it: the default model (the
first), each model's queue name (the default's '', so that one model keeps a one-model deployment's keys), its
directory and its pool's bounds; adapters checked against the models served."""

from __future__ import annotations

import json

import pytest

from shared import names
from shared.served import ServedModel, parse_models
from shared.settings import Settings


def test_models_are_read_in_each_form() -> None:
    assert parse_models("a=/m/a, b=/m/b") == [ServedModel("a", "/m/a"), ServedModel("b", "/m/b")]
    listed = json.dumps([{"name": "a", "path": "/m/a"}, {"name": "b", "path": "/m/b", "min_replicas": 0,
                                                          "max_replicas": 3}])
    assert parse_models(listed) == [ServedModel("a", "/m/a"), ServedModel("b", "/m/b", 0, 3)]
    assert parse_models('{"name": "a", "path": "/m/a"} {"name": "b", "path": "/m/b"}')[1].name == "b"
    assert parse_models("  ") == []


@pytest.mark.parametrize("value, says", [
    ("a", "'a' is not name=path"),
    ("a=/x,a=/y", "'a' is named twice"),
    ("a:b=/x", "must be 1-64 letters"),
    ('{"name": "a"}', "no string 'name' and 'path'"),
    ('{"name": "a", "path": "/x", "min_replicas": -1}', "min_replicas must be an integer"),
    ('{"name": "a", "path": "/x", "min_replica": 0}', r"unknown fields \['min_replica'\]"),  # scale to zero lost
    ('{"name": "a", "path": "/x", "min_replicas": 3, "max_replicas": 1}', "at least min_replicas"),
    ('{"name": "a", "path": "/x", "max_replicas": 0}', "max_replicas must be at least 1"),
])
def test_a_malformed_models_value_names_its_item(value: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_models(value)


def test_one_model_is_the_deployment_without_models() -> None:
    s = Settings(model="/m/solo", inference_min=0)
    assert list(s.served) == ["solo"] and s.default_model == "solo" and s.model_keys == [""]
    assert s.bounds_of("solo") == (0, 1) and s.path_of(None) == "/m/solo"
    assert names.fair_key(0, "queue", s.model_key) == "conveyor:{p0}:fair:queue"
    assert names.inference_pool(s.model_key) == names.INFERENCE_POOL


def test_each_process_reads_its_model_from_models() -> None:
    models = json.dumps([{"name": "a", "path": "/m/a"}, {"name": "b", "path": "/m/b", "min_replicas": 0,
                                                          "max_replicas": 2}])
    api = Settings(models=models)  # the API and the tokenizer pool: every model, the first the default
    assert (api.default_model, api.served_model_name, api.model_path, api.model_key) == ("a", "a", "/m/a", "")
    assert api.model_keys == ["", "b"] and api.path_of("b") == "/m/b" and api.bounds_of("b") == (0, 2)
    worker = Settings(models=models, model="/m/b", model_name="b")  # an inference worker of the second model
    assert (worker.default_model, worker.model_key, worker.model_path) == ("a", "b", "/m/b")
    assert names.stream(names.TOKENIZED, 3, worker.model_key) == "conveyor:{p3}:m:b:tokenized"
    assert names.stream_model("conveyor:{p3}:m:b:tokenized") == "b"
    assert names.stream_kind("conveyor:{p3}:m:b:tokenized") == names.TOKENIZED
    with pytest.raises(ValueError, match="MODEL_NAME 'c' is not one of MODELS"):
        Settings(models=models, model_name="c")


def test_adapters_are_checked_against_the_models_served() -> None:
    models = "a=/m/a,b=/m/b"
    s = Settings(models=models, lora_modules='{"name": "x", "path": "/l/x"} {"name": "y", "path": "/l/y", '
                                             '"base_model_name": "b"}')
    assert {n: m.base_model_name for n, m in s.loras.items()} == {"x": "a", "y": "b"}  # none named: the default's
    with pytest.raises(ValueError, match="'z' is not a model served"):
        Settings(models=models, lora_modules='{"name": "y", "path": "/l/y", "base_model_name": "z"}')
    with pytest.raises(ValueError, match="'b' is a served model's own name"):
        Settings(models=models, lora_modules="b=/l/b")
