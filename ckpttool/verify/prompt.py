"""The tokens ``verify`` feeds a model: a fixed sentence through the checkpoint's own tokenizer, a text file, or
fixed ids spread below the vocab size, so that two runs (and two machines) see the same input."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckpttool.errors import ConfigError, SourceError
from ckpttool.io.paths import read_source_text

#: the fixed sentence verify feeds a checkpoint that ships a tokenizer
SENTENCE = "The quick brown fox jumps over the lazy dog, and then it runs back home again."
#: positions fed when the checkpoint has no tokenizer (fixed ids below its vocab size)
DEFAULT_TOKENS = 16
#: files whose presence means the checkpoint ships a tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


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
        body = read_source_text(Path(text), f"text file '{text}'")
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
    beyond = [i for i in ids if not 0 <= i < vocab]
    if beyond:
        raise ConfigError(f"the tokenizer of '{holder}' gives token id {beyond[0]}, beyond the model's vocab_size "
                          f"{vocab}: tokenizer and model do not match")
    return ids, f"{source}, tokenized by '{holder}'"


def _vocab(path: Path, config: dict[str, Any]) -> int:
    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if not isinstance(vocab, int) or vocab < 1:
        raise ConfigError(f"'{path / 'config.json'}': no positive integer vocab_size")
    return vocab


def _fixed_ids(count: int, vocab: int) -> list[int]:
    """``count`` ids spread over the vocabulary, the same on every machine (no random generator)."""
    return [(7919 * i + 13) % vocab for i in range(count)]


def _encode(path: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SourceError(f"'{path}': its tokenizer does not load: {e}") from None
    return list(tokenizer(text)["input_ids"])
