"""Head patterns are checked when loaded: every malformed file or dict is refused with a message naming it."""

import json
import re

import pytest

from kvpress.patterns import check_pattern, config_hash, load_pattern, packaged
from tiny import tiny_model

HOW = "kvpress calibrate-heads"


def _good(**changes) -> dict:
    model = tiny_model("llama")  # 2 layers x 2 KV heads
    pattern = {"model": "tiny", "config_hash": config_hash(model), "layers": 2, "kv_heads": 2,
               "scores": [[0.1, 0.4], [0.3, 0.2]], "retrieval_fraction": 0.5}  # fmt: skip
    return {key: value for key, value in {**pattern, **changes}.items() if value is not ...}


def _refused(pattern, *fragments, error=ValueError):
    """Load `pattern` (a dict, or JSON text written to a file) and check the refusal names it and the fix."""
    with pytest.raises(error) as info:
        load_pattern(pattern)
    message = str(info.value)
    for fragment in (*fragments, HOW):
        assert fragment in message, (fragment, message)
    return info.value


@pytest.fixture
def write(tmp_path):
    def write(text: str):
        path = tmp_path / "pattern.json"
        path.write_text(text)
        return path

    return write


def test_packaged_patterns_load():
    assert packaged() == ["qwen2.5-0.5b", "smollm2-135m"]
    for name in packaged():
        pattern = load_pattern(name)
        assert len(pattern["scores"]) == pattern["layers"] and len(pattern["scores"][0]) == pattern["kv_heads"]
    assert load_pattern(_good()) == _good()


def test_invalid_json_names_file_and_line(write):
    path = write(json.dumps(_good(), indent=1).replace('"kv_heads": 2,', '"kv_heads": 2'))
    error = _refused(path, str(path), "is not valid JSON at line 6, column 2")
    assert isinstance(error.__cause__, json.JSONDecodeError)
    _refused(write(""), str(path), "line 1")
    path.write_bytes(b"\xff\xfe{")
    _refused(path, str(path), "is not valid JSON")


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_json_literals(write, literal):
    path = write(json.dumps(_good()).replace("0.4", literal))
    _refused(path, str(path), f"{literal} is not a number JSON allows")


def test_not_an_object(write):
    path = write("[[0.1, 0.2]]")
    _refused(path, str(path), "it is a list, not a JSON object")


def test_missing_keys(write):
    path = write(json.dumps(_good(config_hash=..., scores=...)))
    _refused(path, str(path), "lacks the keys ['config_hash', 'scores']")
    _refused(_good(model=...), "given as a dict", "lacks the keys ['model']")


def test_model_and_hash_are_strings():
    _refused(_good(config_hash=1234), "'tiny' (a dict)", "config_hash must be a string, got 1234")
    _refused(_good(model=["tiny"]), "model must be a string")


@pytest.mark.parametrize("scores", [[], {"0": [0.1]}, [[]], [0.1, 0.2], [[0.1], []], "0.1"])
def test_scores_must_be_a_non_empty_matrix(scores):
    _refused(_good(scores=scores, layers=..., kv_heads=...), "'tiny'", "scores must be a non-empty list")


def test_ragged_scores(write):
    path = write(json.dumps(_good(scores=[[0.1, 0.2], [0.3]], layers=..., kv_heads=...)))
    _refused(path, str(path), "scores is ragged: layers have [1, 2] KV heads")


@pytest.mark.parametrize("bad", ["0.3", None, True, [0.3], float("nan"), float("inf"), -float("inf")])
def test_scores_entries_are_finite_reals(bad):
    _refused(_good(scores=[[0.1, 0.2], [0.3, bad]]), "'tiny'", f"scores[1][1] is {bad!r}, not a finite real number")


@pytest.mark.parametrize(
    "changes, message",
    [({"layers": 3}, "layers is 3 but scores has 2"), ({"kv_heads": 1}, "kv_heads is 1 but scores has 2"),
     ({"layers": "2"}, "layers is '2' but scores has 2"),
     ({"scores": [[0.1], [0.2]], "kv_heads": True}, "kv_heads is True but scores has 1")],
)  # fmt: skip
def test_shape_fields_agree_with_scores(changes, message):
    _refused(_good(**changes), "'tiny'", message)


@pytest.mark.parametrize("fraction", [-0.1, 1.5, "0.5", True, float("nan")])
def test_retrieval_fraction_in_unit_interval(fraction):
    _refused(_good(retrieval_fraction=fraction), "'tiny'", f"retrieval_fraction must be in [0, 1], got {fraction!r}")


def test_missing_file_or_directory(tmp_path):
    _refused(tmp_path / "nothing.json", "neither a JSON file nor a packaged pattern", error=FileNotFoundError)
    with pytest.raises(FileNotFoundError, match="neither a JSON file"):
        load_pattern(tmp_path)


def test_check_pattern_refuses_another_architecture_or_a_malformed_dict():
    model = tiny_model("llama")
    check_pattern(_good(), model)
    with pytest.raises(ValueError, match=rf"made for 'tiny' \(config hash 0+, 2 layers x 2 KV heads\).*{HOW}"):
        check_pattern(_good(config_hash="0" * 16), model)
    three = _good(scores=[[0.1, 0.2, 0.3]] * 2, kv_heads=3)
    with pytest.raises(ValueError, match=re.escape("2 layers x 3 KV heads), not for this LlamaForCausalLM")):
        check_pattern(three, model)
    malformed = r"pattern 'tiny' \(a dict\) is malformed: it lacks the keys \['scores'\]; make "
    with pytest.raises(ValueError, match=rf"{malformed}.*{HOW}"):
        check_pattern(_good(scores=...), model)


def test_the_architecture_hash_tells_sliding_window_layers_apart():
    """A pattern, scorer, gates or saved cache made on a model whose layers all attend to the whole context was taken
    by one of the same shape with sliding-window layers (and one Gemma 3 arrangement by another): the hash now names
    each layer's kind and the window where a model has such layers."""
    full, windowed = tiny_model("mistral"), tiny_model("mistral-window")
    assert config_hash(full) != config_hash(windowed)
    with pytest.raises(ValueError, match="made for 'tiny'"):
        check_pattern({**_good(), "config_hash": config_hash(full)}, windowed)
    other = ["full_attention", "sliding_attention", "sliding_attention"]
    assert config_hash(tiny_model("gemma3")) != config_hash(tiny_model("gemma3", layer_types=other))
    assert config_hash(tiny_model("gemma3", sliding_window=8)) != config_hash(tiny_model("gemma3", sliding_window=12))


def test_a_write_killed_half_way_leaves_the_file_it_replaces(tmp_path, monkeypatch):
    """save_pattern truncated the file first: a calibration killed as it wrote (a full disk) left half a pattern in
    place of the good one. Patterns, scorers, gates and saved caches are now written beside and renamed."""
    from pathlib import Path

    from kvpress.patterns import save_pattern
    from kvpress.scorers import save_scorer
    from tiny import tiny_scorer

    model = tiny_model("llama")
    path, weights = tmp_path / "pattern.json", tmp_path / "scorer.safetensors"
    save_pattern(load_pattern("smollm2-135m"), path)
    save_scorer(tiny_scorer(model), weights)
    before = (path.read_bytes(), weights.read_bytes())

    def half(self, data, *args, **kwargs):
        with open(self, "w") as f:
            f.write(data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half)
    with pytest.raises(OSError, match="No space left"):
        save_pattern(load_pattern("qwen2.5-0.5b"), path)
    monkeypatch.undo()
    from kvpress import shipped

    def torn(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"torn")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shipped, "save_file", torn)
    with pytest.raises(OSError, match="No space left"):
        save_scorer(tiny_scorer(model), weights)
    assert (path.read_bytes(), weights.read_bytes()) == before and load_pattern(path)["model"] == "smollm2-135m"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pattern.json", "scorer.safetensors"]  # (no leftovers)


def test_a_file_here_named_as_a_packaged_one_is_refused_not_shadowed(tmp_path, monkeypatch):
    """`kvpress train-scorer --out smollm2-135m` wrote ./smollm2-135m, and every later load of that name read the
    packaged scorer in its place (a pattern likewise): refused now, naming ./smollm2-135m."""
    from kvpress.patterns import save_pattern
    from kvpress.scorers import load_scorer, save_scorer
    from tiny import tiny_pattern, tiny_scorer

    model = tiny_model("llama")
    monkeypatch.chdir(tmp_path)
    save_scorer(tiny_scorer(model), "smollm2-135m")
    save_pattern(tiny_pattern(model), "qwen2.5-0.5b")
    with pytest.raises(ValueError, match=r"scorer 'smollm2-135m' names both a packaged scorer and the file .*: give "
                                         r"that file by its path"):  # fmt: skip
        load_scorer("smollm2-135m")
    import types

    from transformers import AutoConfig

    from kvpress.gates import find_gates
    from kvpress.models import resolve_model_path
    from kvpress.patterns import find_pattern
    from kvpress.scorers import find_scorer

    smol = types.SimpleNamespace(config=AutoConfig.from_pretrained(resolve_model_path(), local_files_only=True))
    # ("auto" finds the packaged files by their paths, whatever lies here)
    assert find_scorer(smol).model == find_gates(smol).model == find_pattern(smol)["model"] == "smollm2-135m"
    with pytest.raises(ValueError, match="head pattern 'qwen2.5-0.5b' names both a packaged head pattern"):
        load_pattern("qwen2.5-0.5b")
    assert load_scorer("./smollm2-135m").model == "tiny" and load_pattern("./qwen2.5-0.5b")["model"] == "tiny"
    (tmp_path / "qwen2.5-0.5b").unlink()
    assert load_pattern("qwen2.5-0.5b")["model"] == "qwen2.5-0.5b"  # (no such file here: the packaged one)


def test_a_whole_write_replaces_a_symlinks_target_keeps_the_mode_and_clears_a_killed_writers_leftover(tmp_path,
                                                                                                      monkeypatch):
    import os

    from kvpress.files import write_text_whole

    synced, replace = [], os.replace  # the new file reaches the disk before it replaces the old one
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")))
    monkeypatch.setattr(os, "replace", lambda src, dst: (synced.append("replace"), replace(src, dst)))

    real, link = tmp_path / "real.json", tmp_path / "link.json"
    real.write_text("old")
    real.chmod(0o664)
    link.symlink_to(real)
    (tmp_path / ".real.json.partial-999999999").write_text("half")  # (a writer killed: no such process)
    write_text_whole(link, "new")
    assert link.is_symlink() and real.read_text() == "new" and oct(real.stat().st_mode & 0o777) == "0o664"
    assert sorted(os.listdir(tmp_path)) == ["link.json", "real.json"]
    assert synced == [os.path.join(os.path.realpath(tmp_path), f".real.json.partial-{os.getpid()}"), "replace"]


def test_a_link_planted_at_a_partial_or_lock_name_is_not_written_through(tmp_path):
    """The temporary file's name is predictable and the lock was opened following links: a link planted there had
    its target overwritten (a whole write), or truncated to the writer's pid (a sweep's lock; an audit)."""
    import os

    from kvpress.files import held_alone, write_text_whole

    victim = tmp_path / "victim"
    victim.write_text("mine")
    (tmp_path / f".out.json.partial-{os.getpid()}").symlink_to(victim)
    write_text_whole(tmp_path / "out.json", "new")
    assert victim.read_text() == "mine" and (tmp_path / "out.json").read_text() == "new"
    assert not (tmp_path / "out.json").is_symlink()
    (tmp_path / ".lock").symlink_to(victim)
    with pytest.raises(ValueError, match="is a symbolic link: this sweep takes its lock in a file of its own"):
        with held_alone(tmp_path / ".lock", "this sweep"):
            pass
    assert victim.read_text() == "mine"
