"""The tokens ``verify`` feeds a model: a fixed sentence through the checkpoint's own tokenizer, a text file, or
fixed ids spread below the vocab size, so that two runs (and two machines) see the same input."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, BinaryIO

from ckpttool.errors import ArgumentError, ConfigError, SourceError
from ckpttool.io.paths import open_source, source_os_error
from ckpttool.verify.guard import refuse_remote_code

#: the fixed sentence verify feeds a checkpoint that ships a tokenizer
SENTENCE = "The quick brown fox jumps over the lazy dog, and then it runs back home again."
#: positions fed when the checkpoint has no tokenizer (fixed ids below its vocab size)
DEFAULT_TOKENS = 16
#: files whose presence means the checkpoint ships a tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
#: the largest text file ``text=`` (``--text``) reads: a prompt, not a corpus (100 MB of text tokenized and fed at
#: once takes gigabytes)
TEXT_LIMIT = 2**20
#: the most tokens verify feeds (``tokens=``, ``--tokens``, or a text's tokens): attention's memory grows with
#: their square
MAX_TOKENS = 4096


def has_tokenizer(path: Path) -> bool:
    return any((path / name).is_file() for name in TOKENIZER_FILES)


def choose_input(path: Path, ref: Path | None, config: dict[str, Any], ref_config: dict[str, Any] | None, tokens: int | None,
           text: str | Path | None) -> tuple[list[int], str]:
    """The token ids both models are fed, and where they came from: ``tokens`` fixed ids, the text of the file
    ``text`` or a fixed sentence encoded by the tokenizer of ``path`` (else of ``ref``), or fixed ids when neither
    ships a tokenizer. Every id is below the smaller vocab size.

    Raises:
        SourceError: ``text`` with no tokenizer, a tokenizer that does not load or encodes to nothing.
        ConfigError: no vocab size, or the tokenizer gives an id beyond it.
    """
    vocab = min([_vocab(path, config), *([_vocab(ref, ref_config)] if ref is not None and ref_config else [])])
    if tokens is not None:
        return _fixed_ids(tokens, vocab), f"{tokens} fixed ids"
    if text is not None:
        body = read_text(text)
        source = f"the text of '{text}'"
    else:
        body, source = SENTENCE, "a fixed sentence"
    holder = next((p for p in (path, ref) if p is not None and has_tokenizer(p)), None)
    if holder is None:
        if text is not None:
            raise SourceError(f"'{path}' has no tokenizer to encode '{text}' with (give --tokens N instead)")
        return _fixed_ids(DEFAULT_TOKENS, vocab), f"{DEFAULT_TOKENS} fixed ids (no tokenizer)"
    ids = _encode(holder, body)
    if not ids:
        raise SourceError(f"the tokenizer of '{holder}' encodes {source} to no tokens")
    if len(ids) > MAX_TOKENS:
        raise SourceError(f"the tokenizer of '{holder}' encodes {source} to {len(ids)} tokens; verify feeds at most "
                          f"{MAX_TOKENS} (--text takes a prompt of at most {MAX_TOKENS} tokens): give a shorter text")
    beyond = [i for i in ids if not 0 <= i < vocab]
    if beyond:
        raise ConfigError(f"the tokenizer of '{holder}' gives token id {beyond[0]}, beyond the model's vocab_size "
                          f"{vocab}: tokenizer and model do not match")
    return ids, f"{source}, tokenized by '{holder}'"


def check_text(text: str | Path) -> int:
    """The size in bytes of the text file ``text``, checked without reading it: a regular file of at most
    :data:`TEXT_LIMIT` bytes.

    Raises:
        SourceError: no such file, not a regular file, unreadable, or larger than the limit.
    """
    with _open_text(text) as f:
        size = os.fstat(f.fileno()).st_size
    if size > TEXT_LIMIT:
        raise SourceError(_too_large(text, size))
    return size


def read_text(text: str | Path) -> str:
    """The UTF-8 text of the file ``text`` (at most :data:`TEXT_LIMIT` bytes are read).

    Raises:
        SourceError: as :func:`check_text`, or the bytes are not UTF-8.
    """
    with _open_text(text) as f:
        try:
            raw = f.read(TEXT_LIMIT + 1)  # the size may change after a stat: the read itself is bounded
        except OSError as e:
            raise SourceError(f"text file {source_os_error(str(text), e)}") from None
    if len(raw) > TEXT_LIMIT:
        raise SourceError(_too_large(text, len(raw), exact=False))
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SourceError(f"text file '{text}': not UTF-8 text (byte {e.start}: {e.reason})") from None


def _open_text(text: str | Path) -> BinaryIO:
    try:
        return open_source(Path(text))
    except SourceError as e:  # "'prompt.txt': cannot read: No such file or directory", said of the --text file
        raise SourceError(f"text file {e}") from None


def _too_large(text: str | Path, size: int, exact: bool = True) -> str:
    return (f"text file '{text}' is {'' if exact else 'more than '}{size} bytes; verify reads at most {TEXT_LIMIT} "
            f"bytes (1 MiB) of text (--text takes a prompt of at most 1 MiB and {MAX_TOKENS} tokens)")


def check_tokens(tokens: int) -> None:
    """Refuse a count of fixed ids outside 1..:data:`MAX_TOKENS`.

    Raises:
        ArgumentError: naming ``tokens=`` and the bound.
    """
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= MAX_TOKENS:
        raise ArgumentError(f"tokens={tokens!r}: feed 1 to {MAX_TOKENS} tokens")


def _vocab(path: Path, config: dict[str, Any]) -> int:
    # a vision-language config may state both, and differently (PaliGemma's top level keeps its default 257152
    # over a smaller text model): ids must fit the embedding of the language model, the smaller one
    stated = [v for v in (config.get("vocab_size"), (config.get("text_config") or {}).get("vocab_size"))
              if isinstance(v, int) and v > 0]
    vocab = min(stated) if stated else None
    if vocab is None:
        raise ConfigError(f"'{path / 'config.json'}': no positive integer vocab_size")
    return vocab


def _fixed_ids(count: int, vocab: int) -> list[int]:
    """``count`` ids spread over the vocabulary, the same on every machine (no random generator)."""
    return [(7919 * i + 13) % vocab for i in range(count)]


def _encode(path: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    refuse_remote_code(path)  # transformers would ask on stdin whether to run the tokenizer's own code
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False, local_files_only=True)
    except Exception as e:  # the checkpoint's files, parsed by transformers and tokenizers: any failure is theirs
        raise SourceError(f"'{path}': its tokenizer does not load: {type(e).__name__}: {e}") from None
    try:
        return list(tokenizer(text)["input_ids"])
    except Exception as e:
        raise SourceError(f"'{path}': its tokenizer fails on the text: {type(e).__name__}: {e}") from None
