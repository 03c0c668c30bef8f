"""model.py: the first-run fetch of the bundled model is done once, even when several processes start at once."""
import threading
import time

import model as models


def test_parallel_first_runs_fetch_and_convert_once(tmp_path, monkeypatch):
    """torchrun's ranks (or two runs) start together on an empty cache: one fetches and converts, the others wait
    for the lock and then find the model. (flock locks are per open file, so threads contend like processes.)"""
    monkeypatch.setenv("RSTAR2_CACHE", str(tmp_path))
    inside, most, calls = [0], [0], []

    def slow_convert(gguf, dest):
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        calls.append(dest)
        time.sleep(0.3)
        dest.mkdir(parents=True)
        (dest / "config.json").write_text("{}")
        (dest / "model.safetensors").write_text("")
        inside[0] -= 1

    monkeypatch.setattr(models, "_fetch_gguf", lambda cache: cache / "fake.gguf")
    monkeypatch.setattr(models, "_convert_gguf", slow_convert)
    results = []
    threads = [threading.Thread(target=lambda: results.append(models.ensure_default_model())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and most[0] == 1
    assert results == [tmp_path / "SmolLM2-135M-Instruct"] * 4
