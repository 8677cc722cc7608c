"""`make bench-chat` writes each chat's rows as it goes, resumes from them, and reports intervals."""

import json

import pytest

from kvpress.eval.bench_chat import bench


def _rows(example: int) -> dict[str, dict]:
    row = lambda score: {"score": score, "bytes_ratio_last": 1.0, "bytes_ratio_mean": 1.0, "store_bytes": 0,  # noqa: E731
                         "bytes_last": 10, "tokens_fed_per_turn": [4, 6], "selected": [1], "fact_round": 1}  # fmt: skip
    return {"full": row(1.0), "round": row(float(example % 2))}


def test_a_run_resumes_from_its_rows_and_reports_wilson_intervals(tmp_path):
    log, settings, played = tmp_path / "chat.jsonl", {"model": "m", "seed": 0}, []

    def play(example):
        played.append(example)
        if played == [0, 1, 2]:
            raise KeyboardInterrupt  # a run stopped in its third chat
        return _rows(example)

    with pytest.raises(KeyboardInterrupt):
        bench([0, 1, 2, 3], play, log, settings)
    assert len(log.read_text().splitlines()) == 3  # the settings and two chats, written as they finished
    with log.open("a") as f:
        f.write('{"example": 2, "rows": {"full"')  # a line the stop cut off: dropped, played again
    result = bench([0, 1, 2, 3], play, log, settings)
    assert played == [0, 1, 2, 2, 3]  # only the chats not written whole were played again
    summary = result["summary"]["round"]
    assert summary["accuracy"] == 0.5 and summary["n"] == 4
    assert summary["accuracy_interval"] == pytest.approx([0.15, 0.85], abs=0.01)  # Wilson's, 2 of 4
    assert result["summary"]["full"]["accuracy_interval"][1] == 1.0 and len(result["rows"]["round"]) == 4
    # against the full cache chat by chat (-1, 0, -1, 0): t(3) sd / 2 = 0.919 about -0.5, clipped at -1
    assert summary["minus_full"] == -0.5 and summary["minus_full_interval"] == pytest.approx([-1.0, 0.419], abs=1e-3)
    assert summary["fact_round_selected"] == 1.0 and summary["fact_round_selected_interval"] == pytest.approx(
        [0.51, 1.0], abs=0.01)  # Wilson's, 4 of 4
    assert result["summary"]["full"]["minus_full_interval"] is None  # (the full cache against itself)
    still = bench([0, 1, 2, 3], lambda example: {"full": _rows(example)["full"], "round": _rows(example)["full"]})
    # no chat moved: t collapses to [0, 0]; 4 chats bound how many could move (Wilson's 0 of 4: 0.49)
    assert still["summary"]["round"]["minus_full_interval"] == pytest.approx([-0.49, 0.49], abs=1e-3)
    assert [json.loads(line).get("example") for line in log.read_text().splitlines()] == [None, 0, 1, 2, 3]
    with pytest.raises(ValueError, match="other settings"):
        bench([0], play, log, {"model": "m", "seed": 1})
    with pytest.raises(ValueError, match=r"holds chats 2..3 of a run of more examples than 2: run with --examples 4"):
        bench([0, 1], play, log, settings)  # (chats 2 and 3 would be left out, and their log removed)


@pytest.mark.parametrize("argv, said", [
    (["--out", "chat.jsonl"], "name it otherwise than chat.jsonl"),  # its rows' log: written, then removed
    (["--top-k", "-1"], "top_k_rounds must be a non-negative integer, got -1"),  # refused after a full-cache chat
    (["--rounds", "3"], "need n >= 1, rounds >= 2 and 2 <= plant_within < rounds"),  # refused once the model loaded
    (["--examples", "0"], "need n >= 1"),
])  # fmt: skip
def test_bad_arguments_are_refused_before_the_model_loads(argv, said, capsys, monkeypatch):
    import kvpress
    from kvpress.eval.bench_chat import main

    monkeypatch.setattr(kvpress, "load_model", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(SystemExit):
        main(argv)
    assert said in capsys.readouterr().err


def test_a_log_of_other_settings_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """A resumed run's log of other settings was refused once the model had loaded, as a traceback."""
    import kvpress
    from kvpress.eval.bench_chat import main

    (tmp_path / "chat.jsonl").write_text(json.dumps({"settings": {"model": "m", "seed": 1}}) + "\n")
    monkeypatch.setattr(kvpress, "load_model", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "chat.json"), "--examples", "1"])
    assert "chat.jsonl holds a run with other settings" in capsys.readouterr().err
