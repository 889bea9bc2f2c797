"""The digest of an output file, taken as it is written and computed again on ``--resume`` and ``--verify``.

It checks that a file still holds what was written (a damaged disk, a file changed since), nothing more: the
sha256 of :data:`DIGEST_SCHEME`, of the header's sha256, then one token per chunk in file order. A chunk built in
a buffer gives its CRC-32 (damage goes unseen with odds of 1 in 2**32; no proof against tampering, which the
journal never was), at 3 times sha256's speed. A chunk copied file to file (:mod:`ckpttool.execute.copies`) is
never seen as it is written, so it gives a fixed token; computed again, it gives that token only when its bytes
equal their source's byte for byte, sources that the journal's plan identity (their sizes and modification times)
says are unchanged. A journal of another scheme is not trusted (see :class:`ckpttool.writers.journal.Journal`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import BinaryIO

from ckpttool.execute.buffers import Chunk
from ckpttool.fast.crc import crc32
from ckpttool.execute.copies import Span, copied
from ckpttool.execute.reads import Reader

__all__ = ["COPIED", "DIGEST_SCHEME", "FromSource", "checks", "crc_token", "recheck", "running"]

#: what a file's digest is made of: a journal recording digests made another way is never trusted
DIGEST_SCHEME = b"ckpttool file digest 2: sha256 of the header; per chunk its CRC-32, or a copy checked against its source\n"
#: the token of a chunk copied file to file (as written, and computed again when it equals its source)
COPIED = b"copy"
#: the token of a copied chunk that differs from its source (or is short)
DIFFERS = b"diff"
#: the most bytes read at once to compute a digest again
WINDOW = 8 * 2**20


def running(prefix: bytes) -> hashlib._Hash:
    """The digest of a file whose header is ``prefix``, to which each chunk's token is added in file order."""
    return hashlib.sha256(DIGEST_SCHEME + hashlib.sha256(prefix).digest())


def crc_token(crc: int) -> bytes:
    """The token of a chunk built in a buffer, from its CRC-32 (taken once, as it is written)."""
    return crc.to_bytes(4, "big")


@dataclass(frozen=True, slots=True)
class FromSource:
    """A chunk copied file to file: the spans it was copied from, and the reader of their files."""

    spans: tuple[Span, ...]
    reader: Reader


def checks(chunk_list: Sequence[Chunk], reader: Reader) -> list[int | FromSource]:
    """How :func:`recheck` computes each chunk's token again: its size (a chunk built: its CRC-32), or where it
    was copied from (see :func:`ckpttool.execute.copies.copied`), read with ``reader``."""
    found: list[int | FromSource] = []
    for chunk in chunk_list:
        spans = copied(chunk)
        found.append(chunk.nbytes if spans is None else FromSource(spans, reader))
    return found


def recheck(f: BinaryIO, check: int | FromSource, buffers: tuple[bytearray, bytearray]) -> bytes:
    """A chunk's token computed again from the next bytes of ``f`` (see :func:`checks`); a copied chunk is read
    with its source, :data:`WINDOW` bytes at a time, into ``buffers``."""
    mine, theirs = (memoryview(b) for b in buffers)
    if isinstance(check, int):
        crc, left = 0, check
        while left > 0:
            got = f.readinto(mine[:min(left, len(mine))])
            if not got:  # a short file: its digest differs
                break
            crc, left = crc32(mine[:got], crc), left - got
        return crc_token(crc)
    at = f.tell()
    same = True
    for piece, start, rel, nbytes in check.spans:
        done = 0
        while same and done < nbytes:
            n = min(nbytes - done, len(mine))
            f.seek(at + rel + done)
            got = f.readinto(mine[:n])
            check.reader.read_into(theirs[:n], piece, start + done)
            same = got == n and (buffers[0] == buffers[1] if n == len(mine) else mine[:n] == theirs[:n])
            done += n
    f.seek(at + sum(n for *_, n in check.spans))
    return COPIED if same else DIFFERS
