import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(scope="session")
def tokenized():
    """SmolLM2's tokenizer over a tiny random 3-layer Llama of its vocabulary (no weights loaded)."""
    from transformers import AutoTokenizer

    from kvpress.models import resolve_model_path
    from tiny import tiny_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(), local_files_only=True)
    return tiny_model("llama", num_hidden_layers=3, vocab_size=len(tokenizer)), tokenizer


@pytest.fixture(autouse=True)
def _inference():
    with torch.inference_mode():
        yield


@pytest.fixture(autouse=True)
def _tiny_scorers(monkeypatch):
    """KVzapPress's scorer="auto" and NAtSPress's gates="auto" on a tiny model (nothing packaged fits it): fixed
    random linear scorers and gates, so every test that runs the registry's presses runs KVzap and NAtS too."""
    from kvpress.presses import kvzap, nats
    from tiny import tiny_gates, tiny_scorer

    for module, name, make in ((kvzap, "find_scorer", tiny_scorer), (nats, "find_gates", tiny_gates)):
        real = getattr(module, name)

        def find(model, real=real, make=make):
            try:
                return real(model)
            except ValueError:
                return make(model)

        monkeypatch.setattr(module, name, find)
