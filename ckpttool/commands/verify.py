"""The ``verify`` command: load a written checkpoint as transformers will, run a forward, and compare its logits
with a reference's, merging a sharded reference first.

The check itself (the forward, the tolerance, the comparison) is :mod:`ckpttool.verify`'s; what this command adds
is the order (every path and config checked before anything heavy) and the reference's merge, which is a command.
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

from ckpttool.errors import ArgumentError, SourceNotFoundError
from ckpttool.verify import Tolerance, VerifyResult, compare, tolerance_for
from ckpttool.verify.forward import Forward, read_config, run_forward
from ckpttool.verify.guard import check_config, refuse_remote_code
from ckpttool.verify.image import ImageInput, image_input
from ckpttool.verify.prompt import check_text, check_tokens, choose_input

__all__ = ["verify"]


def verify(
    out: str | Path,
    *,
    against: str | Path | None = None,
    tokens: int | None = None,
    text: str | Path | None = None,
    tolerance: Tolerance | float | None = None,
    stream: bool = True,
) -> VerifyResult:
    """Load ``out`` as transformers will and run a forward; with ``against``, compare with the reference.

    Args:
        out: a HuggingFace directory (``config.json`` + safetensors), e.g. what ``merge`` wrote.
        against: the reference, in any format ckpttool reads; a sharded one is merged to a temporary directory.
        tokens: feed this many fixed token ids (below the vocab size) instead of the tokenizer's sentence.
        text: a text file to tokenize with the checkpoint's tokenizer and feed instead.
        tolerance: when the logits count as equal; by default :func:`tolerance_for` the dtypes compared; a float
            replaces that default's ``max_rel`` (the largest |Δlogit| relative to the reference's logit scale).
        stream: load one module at a time from disk (bounded memory); False loads each model whole.

    Returns:
        A :class:`VerifyResult`; ``result.ok`` is False when loading was not strict, the logits are not finite or
        carry no information, or they differ from the reference's beyond the tolerance. A vision-language model
        (Qwen2/2.5/3-VL, Gemma 3) runs a second forward with a small synthetic image (:mod:`ckpttool.verify.image`),
        compared the same way (``result.image_comparison``).

    Every path is checked first (``out``, ``against``, ``text``), then each directory's configs, before a
    reference is merged or transformers reads a file. A directory whose configs name code to import
    (``auto_map``) is refused: verify never runs code shipped in a checkpoint, and never reads stdin.

    Raises:
        ArgumentError: both ``tokens`` and ``text``, or ``tokens`` outside 1..:data:`ckpttool.verify.MAX_TOKENS`.
        SourceNotFoundError: ``out`` or ``against`` does not exist.
        ConfigError: a config names code to import (``auto_map``), or holds a value transformers cannot load
            (a ``pad_token_id`` outside the vocab, an unknown ``quantization_config.quant_method``, a kernel
            other than torch's, a non-positive size, fewer ``max_position_embeddings`` than tokens fed).
        SourceError: ``text`` is larger than :data:`ckpttool.verify.TEXT_LIMIT` bytes or encodes to more than
            :data:`ckpttool.verify.MAX_TOKENS` tokens; a model cannot be read or loaded.

    Example:
        >>> ckpttool.verify("out/llama", against="ckpt/").ok  # doctest: +SKIP
    """
    if tokens is not None and text is not None:
        raise ArgumentError("tokens= and text= both given: feed fixed token ids or a text, not both")
    if tokens is not None:
        check_tokens(tokens)
    path = Path(out)
    _check_paths(path, Path(against) if against is not None else None, text)
    config = _checked_config(path, tokens)
    if against is not None and Path(against).is_dir():
        refuse_remote_code(Path(against))  # a sharded reference's own configs, before merge copies them
    with tempfile.TemporaryDirectory(prefix="ckpttool-verify-ref-") as scratch:
        ref = _as_hf(Path(against), Path(scratch)) if against is not None else None
        ref_config = _checked_config(ref, tokens) if ref is not None else None
        ids, source = choose_input(path, ref, config, ref_config, tokens, text)
        image = image_input(path, config)  # a vision-language model: a second forward, with an image
        seen = image if isinstance(image, ImageInput) else None
        output = run_forward(path, ids, stream=stream, image=seen)
        if isinstance(image, str):
            output = replace(output, notes=(*output.notes, image))
        if ref is None:
            return VerifyResult(tuple(ids), source, output, image_from=seen.source if seen else None)
        reference = run_forward(ref, ids, stream=stream, image=seen)
    reference = _labelled(reference, str(against))
    chosen = tolerance_for(output.dtype, reference.dtype)
    if isinstance(tolerance, Tolerance):
        chosen = tolerance
    elif tolerance is not None:
        chosen = replace(chosen, max_rel=float(tolerance))
    comparison = image_comparison = None
    if output.logits.numel() and reference.logits.numel():
        comparison = compare(output.logits, reference.logits, chosen)
    if output.image_logits is not None and reference.image_logits is not None:
        image_comparison = compare(output.image_logits, reference.image_logits, chosen)
    return VerifyResult(tuple(ids), source, output, reference, comparison, seen.source if seen else None,
                        image_comparison)


def _check_paths(out: Path, against: Path | None, text: str | Path | None) -> None:
    """Every path argument exists (and the text is small enough) before anything is read or merged."""
    if not out.is_dir():
        raise SourceNotFoundError(f"'{out}': no such directory")
    if against is not None and not against.exists():
        raise SourceNotFoundError(f"reference '{against}': no such file or directory")
    if text is not None:
        check_text(text)


def _checked_config(path: Path, tokens: int | None) -> dict[str, object]:
    """The config of the HF directory ``path``, refused when it names code to run or values transformers
    cannot load (the length of a text or sentence is checked once it is tokenized)."""
    config = read_config(path)
    refuse_remote_code(path)
    check_config(path, config, tokens)
    return config


def _labelled(forward: Forward, path: str) -> Forward:
    return replace(forward, path=path)


def _as_hf(ref: Path, scratch: Path) -> Path:
    """The reference as an HF directory: itself when it is one of safetensors, else merged (unaudited) into
    ``scratch``; ``.bin`` weights too, which transformers would unpickle and ckpttool reads without running a pickle."""
    from ckpttool.commands.merge import merge
    from ckpttool.readers import detect_format, hf

    if not ref.exists():
        raise SourceNotFoundError(f"reference '{ref}': no such file or directory")
    if detect_format(ref) == "hf" and hf.SAFETENSORS.present(ref) and (ref / "config.json").is_file():
        return ref
    merged = scratch / "reference"
    merge(ref, merged, audit=False)
    return merged
