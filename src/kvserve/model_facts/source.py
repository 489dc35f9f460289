"""Where a model is, and what it says about itself without its weights: its
ModelConfig and its tokenizer, from whichever source it comes.

A source is the embedded default model (no path), a *.gguf file, a Hugging
Face folder (config.json + *.safetensors + tokenizer.json), or a folder
holding exactly one *.gguf. The weight loader (model/loader.py) resolves
paths here, and `load_tokenizer` is the one tokenizer loader: the engine,
the server, `kvserve bench` (exact prompt lengths) and the tests use it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from kvserve.model_facts import hf_config
from kvserve.model_facts.config import SUPPORTED_ARCHITECTURES, ModelConfig, ModelLoadError
from kvserve.model_facts.default_model import default_model_path
from kvserve.model_facts.gguf_metadata import GGUFFacts, GGUFIndex
from kvserve.model_facts.tokenizer import Tokenizer

SUPPORTED_SOURCES = (
    "no path (the embedded default model), a *.gguf file, or a Hugging Face folder "
    f"(config.json + *.safetensors + tokenizer.json); architectures: {', '.join(SUPPORTED_ARCHITECTURES)}")
T = TypeVar("T")


def resolve_source(path: str | os.PathLike | None) -> Path:
    """The file or HF folder to read. A folder holding one *.gguf and no
    config.json means that file (e.g. a downloaded GGUF repo)."""
    source = default_model_path() if path is None else Path(path).expanduser()
    if not source.exists():
        raise ModelLoadError(f"model path {str(source)!r} does not exist (kvserve reads local files only, "
                             f"it never downloads); expected {SUPPORTED_SOURCES}")
    if source.is_dir() and not (source / hf_config.CONFIG_FILE).exists():
        ggufs = sorted(source.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        if ggufs:
            raise ModelLoadError(f"{source} holds several GGUF files; pass one: {[g.name for g in ggufs]}")
    return source


def open_gguf(path: Path) -> GGUFFacts:
    """The metadata of a GGUF file (no tensor is read)."""
    if not path.is_file() or not _has_gguf_magic(path):
        raise ModelLoadError(f"{path} is not a GGUF file (no GGUF magic); expected {SUPPORTED_SOURCES}")
    return guard_malformed(lambda: GGUFFacts(GGUFIndex(path)), path)


def read_model_config(path: str | os.PathLike | None = None) -> ModelConfig:
    """The ModelConfig of a source (see the module docstring); every failure
    is a ModelLoadError saying what is wrong and what is supported."""
    source = resolve_source(path)
    if source.is_dir() or source.suffix == ".json":
        return hf_config.read_config(source)
    facts = open_gguf(source)
    return guard_malformed(facts.config, source)


def load_tokenizer(path: str | os.PathLike | None = None) -> Tokenizer:
    """The tokenizer of a source (no weights are read), or of a bare
    tokenizer.json file; same errors as `read_model_config`."""
    source = resolve_source(path)
    if source.is_file() and source.suffix == ".json":
        return Tokenizer.from_hf_folder(source.parent, tokenizer_file=source.name)
    if source.is_dir():
        return read_hf_tokenizer(source, hf_config.read_config(source))
    facts = open_gguf(source)
    return guard_malformed(lambda: facts.tokenizer(facts.config()), source)


def read_hf_tokenizer(folder: Path, config: ModelConfig) -> Tokenizer:
    """An HF folder's tokenizer.json + tokenizer_config.json; `config`'s EOS
    ids (generation_config.json) come first."""
    if not (folder / "tokenizer.json").is_file():
        raise ModelLoadError(f"{folder}: no tokenizer.json (kvserve reads fast-tokenizer files only)")
    return Tokenizer.from_hf_folder(folder, eos_token_ids=config.eos_token_ids)


def guard_malformed(read: Callable[[], T], path: Path) -> T:
    """Run a reader over a file that may be truncated or malformed: numpy and
    gguf raise assorted errors for bad offsets; turn them into ModelLoadError."""
    try:
        return read()
    except ModelLoadError:
        raise
    except (ValueError, IndexError, KeyError, TypeError, OSError, RuntimeError) as e:
        raise ModelLoadError(f"{path}: malformed or truncated model file ({type(e).__name__}: {e})") from e


def _has_gguf_magic(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"
