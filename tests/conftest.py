import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
# `make test` runs the suite in two worker processes (pytest-xdist, `-n 2`), one thread each: the tiny models'
# ops gain little from a second thread, two processes run about twice as fast on two cores
torch.set_num_threads(1 if "PYTEST_XDIST_WORKER" in os.environ else max(1, min(2, torch.get_num_threads())))


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


@pytest.fixture
def varlen_on_cpu(monkeypatch):
    """The head-wise attention's CUDA call, run on the CPU through the stand-in (fp32 taken as the kernel's dtype)."""
    from kvpress.patches import headwise_attention as hw
    from tiny import VARLEN_CALLS, flash_varlen_stand_in

    monkeypatch.setattr(hw, "VARLEN_DEVICES", ("cpu",))
    monkeypatch.setattr(hw, "FLASH_DTYPES", (*hw.FLASH_DTYPES, torch.float32))
    monkeypatch.setattr(hw, "flash_varlen", flash_varlen_stand_in)
    hw._flash_runs_on.cache_clear()
    assert hw._flash_runs_on(torch.device("cpu"))  # the stand-in passes the kernel's check (its one call)
    VARLEN_CALLS.clear()
    yield VARLEN_CALLS
    hw._flash_runs_on.cache_clear()


@pytest.fixture
def short_answers(monkeypatch):
    """Sweep answers of at most 12 tokens (a needle's key and its words fit), for tests whose checks do not hang on
    the tasks' full budgets: the real model's answers take most of a sweep's time."""
    from kvpress.eval import tasks as task_module

    for task, budget in task_module.ANSWER_TOKENS.items():
        monkeypatch.setitem(task_module.ANSWER_TOKENS, task, min(budget, 12))
