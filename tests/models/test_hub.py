"""Models named by Hugging Face hub ID, found in the local Hugging Face cache as vLLM finds them."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

import models
from models.loader import DEFAULT_HUB_ID, default_gguf
from tests.models.tiny_models import write_checkpoint


def cache_with(cache, repo_id: str, source) -> None:
    """Put the checkpoint directory ``source`` into the hub cache at ``cache`` as ``repo_id``'s
    main revision (the layout ``huggingface_hub`` writes)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    shutil.copytree(source, repo / "snapshots" / "0123abcd")


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty hub cache, offline (nothing is downloaded)."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_a_hub_id_in_the_local_cache_is_its_snapshot(hub_cache, tmp_path):
    write_checkpoint("llama_gqa_tied", tmp_path / "tiny")
    cache_with(hub_cache, "test-org/tiny-llama", tmp_path / "tiny")
    path = models.resolve("test-org/tiny-llama")
    assert path == hub_cache / "models--test-org--tiny-llama" / "snapshots" / "0123abcd"
    config, _, _ = models.load_model("test-org/tiny-llama")
    assert config.num_layers == 2


def test_hf_home_locates_the_cache_when_hf_hub_cache_is_unset(hub_cache, tmp_path, monkeypatch):
    write_checkpoint("llama_gqa_tied", tmp_path / "tiny")
    cache_with(tmp_path / "home" / "hub", "test-org/tiny-llama", tmp_path / "tiny")
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert models.resolve("test-org/tiny-llama").parent.parent.parent == tmp_path / "home" / "hub"


def test_a_missing_hub_id_is_one_clear_error(hub_cache):
    with pytest.raises(models.ModelLoadError) as error:
        models.resolve("test-org/not-there")
    assert str(error.value).startswith(f"'test-org/not-there' is not in the Hugging Face cache ({hub_cache}), and "
                                       "HF_HUB_OFFLINE is set")
    assert "\n" not in str(error.value)


def test_the_default_models_hub_id_is_the_shipped_gguf_when_not_cached(hub_cache):
    assert models.resolve(DEFAULT_HUB_ID) == default_gguf()


def test_the_server_reports_a_missing_model_in_one_line(hub_cache):
    done = subprocess.run([sys.executable, "-m", "engine.serve", "test-org/not-there", "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("error: 'test-org/not-there' is not in the Hugging "
                                                            "Face cache")
