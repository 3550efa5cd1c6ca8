"""The reference log-probs' file (zero_recipes/preference/reference.py): a run from a model directory reads back
what it stored (a relaunch or resume depends on it), and another model's file is refused in one line."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from zero_recipes.config.train_config import TrainConfig
from zero_recipes.errors import ConfigError
from zero_recipes.preference import reference


def store(path, meta, n=3):
    with open(path, "wb") as f:
        np.savez(f, meta=json.dumps(meta), train=np.arange(2.0 * n).reshape(n, 2), eval=np.zeros((0, 2)))


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"weights")
    (d / "metrics.jsonl").write_text("")  # a run directory's log: not the model
    return d


def prepared(tmp_path):
    return SimpleNamespace(key="pairs-key", entry=tmp_path, train=[0, 1, 2], eval=None)


def test_a_model_directorys_reference_reads_back_and_ignores_the_runs_logs(model_dir, tmp_path):
    cfg = TrainConfig(model_name_or_path=str(model_dir))
    path, meta = reference.cache_path(cfg, prepared(tmp_path), "bf16")
    store(path, meta)
    (model_dir / "metrics.jsonl").write_text("a relaunch appended to the log\n")
    path_again, meta_again = reference.cache_path(cfg, prepared(tmp_path), "bf16")
    assert path_again == path
    got = reference.load(path_again, meta_again)
    assert torch.equal(got["train"], torch.arange(6.0, dtype=torch.float64).reshape(3, 2))
    reference.check_given_file(TrainConfig(model_name_or_path=str(model_dir), reference_cache=str(path)), "bf16")


def test_another_models_file_is_refused(model_dir, tmp_path):
    cfg = TrainConfig(model_name_or_path=str(model_dir), reference_cache=str(tmp_path / "ref.npz"))
    _, meta = reference.cache_path(TrainConfig(), prepared(tmp_path), "fp32")  # the embedded model's random init
    store(tmp_path / "ref.npz", meta)
    with pytest.raises(ConfigError) as e:
        reference.check_given_file(cfg, "fp32")
    assert "holds the reference log-probs of another model (a random init (seed 42), fp32" in str(e.value)


def test_retrained_weights_in_the_same_directory_get_a_new_file(model_dir, tmp_path):
    cfg = TrainConfig(model_name_or_path=str(model_dir))
    before = reference.cache_path(cfg, prepared(tmp_path), "fp32")[0]
    (model_dir / "model.safetensors").write_bytes(b"other weights")
    assert reference.cache_path(cfg, prepared(tmp_path), "fp32")[0] != before
