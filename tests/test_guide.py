"""The README's "Write a press" guide works as written: its press is the file in the repository, its
`model.generate` example compresses, and its `kvpress sweep` line runs."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT.joinpath("README.md").read_text().split("## Write a press", 1)[1].split("\n## ", 1)[0]
BLOCKS = re.findall(r"```(python|bash)\n(.*?)```", GUIDE, re.S)


def test_the_guide_shows_the_press_file_whole():
    press = BLOCKS[0][1]
    assert press == ROOT.joinpath("kvpress/presses/keydiff.py").read_text()
    assert len(press.splitlines()) <= 30


def test_the_guide_runs_as_written(capsys):
    namespace: dict = {}
    exec(compile(BLOCKS[1][1], "README.md (guide)", "exec"), namespace)  # noqa: S102
    cache, ids = namespace["cache"], namespace["ids"]
    held = cache.layers[0].n
    assert cache.get_seq_length() == ids.shape[1] + 7  # positions count every token seen
    assert held <= ids.shape[1] - ids.shape[1] // 2 + 7  # half the prompt evicted, the answer's tokens kept
    assert "bytes kept for" in capsys.readouterr().out


@pytest.mark.parametrize("line", [b for kind, b in BLOCKS if kind == "bash" and "kvpress sweep" in b])
def test_the_guides_sweep_runs(line, tmp_path, short_answers):
    from kvpress.eval.sweep import main

    args = shlex.split(line.strip())[2:]
    args[args.index("--out") + 1] = str(tmp_path)
    assert main(args) == 0
    rows = (tmp_path / "results.jsonl").read_text().splitlines()
    assert any('"keydiff"' in row for row in rows)
