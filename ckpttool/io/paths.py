"""Paths taken from checkpoint metadata stay inside the checkpoint; outputs never land inside a source."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import BinaryIO

from ckpttool.console.terminal import quoted
from ckpttool.errors import LinkOutError, SourceError

#: a repository folder of the Hugging Face hub cache: ``models--org--name`` (also datasets and spaces)
_HUB_REPO = re.compile(r"(models|datasets|spaces)--.+")


def link_boundary(folder: Path) -> Path:
    """The folder that symlinks in ``folder`` may lead into (resolved): ``folder`` itself, or, when ``folder``
    is (inside) a snapshot of the Hugging Face hub cache, the cache's repository folder.

    The hub cache keeps each file once, in ``models--org--name/blobs/<sha>``, and each revision as
    ``models--org--name/snapshots/<rev>/`` whose files are relative symlinks to ``../../blobs/<sha>``; a
    checkpoint there is whole only with its links followed, and only as far as that repository folder.

    Example:
        >>> link_boundary(Path("hub/models--org--tiny/snapshots/abc"))  # doctest: +SKIP
        PosixPath('/home/me/hub/models--org--tiny')
    """
    real = folder.resolve()
    for snapshot in (real, *real.parents):
        snapshots, repo = snapshot.parent, snapshot.parent.parent
        if snapshots.name == "snapshots" and _HUB_REPO.fullmatch(repo.name) and (repo / "blobs").is_dir():
            return repo
    return real


def inside(root: Path, relative: str, *, named_by: str, within: Path | None = None) -> Path:
    """Resolve ``relative`` (a path some metadata file names) under ``root``, refusing escapes.

    Absolute paths and ``..`` components that lead outside ``root`` are refused, and so are symlinks that
    lead outside it (outside its hub cache repository folder for a snapshot of the hub cache, see
    :func:`link_boundary`), so a crafted index or metadata file cannot make ckpttool read ``/etc/passwd``.
    With ``within`` (a folder above ``root``, the source), links may lead anywhere inside ``within``.

    Raises:
        SourceError: the path leaves the checkpoint directory.
    """
    if "\0" in relative:
        raise SourceError(f"'{named_by}' names a path with a NUL byte ({relative!r}); no file can have that name")
    if os.path.isabs(relative) or relative.startswith(("/", "\\")):
        raise SourceError(f"'{named_by}' names the absolute path '{relative}'; files must lie inside the checkpoint")
    boundary = link_boundary(root if within is None else within)
    named = os.path.normpath(relative)
    parent = named == os.pardir or named.startswith(os.pardir + os.sep)
    try:
        link = not parent and not is_within(root / relative, boundary)
    except RuntimeError:  # Path.resolve on a symlink loop (Python < 3.13)
        raise SourceError(f"'{named_by}' names '{relative}', a symlink loop") from None
    if parent or link:
        source = root if within is None else within
        where = "" if boundary == source.resolve() else f" and its hub cache folder '{boundary}'"
        raise (LinkOutError if link else SourceError)(
            f"'{named_by}' names '{relative}', which leads outside the checkpoint directory{where}")
    return root / relative


def link_escapes(path: Path, folder: Path) -> Path | None:
    """Where ``path`` (a file of ``folder``) leads when it is a symlink out of ``folder``'s
    :func:`link_boundary`; None when it stays inside (or is no symlink)."""
    try:
        target = path.resolve()
    except RuntimeError:  # a symlink loop (Python < 3.13): it leads nowhere, and never out
        return None
    return None if is_within(target, link_boundary(folder)) else target


def escaping_link(root: Path, relative: str, *, within: Path | None = None) -> tuple[str, Path] | None:
    """The first part of ``relative`` (a file or folder under ``root``) that is a symlink leading out of ``root``'s
    :func:`link_boundary` (``within``'s, when given: a reader working in a folder of the source, such as a Megatron
    iteration, may follow links anywhere in the source), and where it leads; None when every link on the way stays
    inside.

    Only the parts of ``relative`` are looked at (``lstat`` each, ``resolve`` the links): ``root`` itself may be
    reached through links, and a link to another link inside ``root`` is judged by where the chain ends.

    Example:
        >>> escaping_link(root, "global_step2/zero/w/fp32.pt")  # doctest: +SKIP
        ('global_step2/zero/w', PosixPath('/elsewhere/w'))
    """
    boundary: Path | None = None
    parts = Path(relative).parts
    here = root
    for i, part in enumerate(parts):
        here = here / part
        if not here.is_symlink():
            continue
        try:
            target = here.resolve()
        except RuntimeError:  # a symlink loop (Python < 3.13): it leads nowhere, and opening it fails
            return None
        boundary = boundary or link_boundary(root if within is None else within)
        if not is_within(target, boundary):
            return "/".join(parts[:i + 1]), target
    return None


def contained(root: Path, relative: str, *, within: Path | None = None) -> Path:
    """``root / relative``, once no symlink on the way there leads out of the source (:func:`escaping_link`).

    Every file and folder a reader opens, lists or stats goes through this (or :func:`open_inside`,
    :func:`read_inside`, :func:`list_inside`): the README's rule is that links are followed only inside the source.

    A link out to a FIFO or a device (``/dev/zero``) is left to :func:`open_source`, which refuses it as not a
    regular file without reading it: that says more than where it leads.

    Raises:
        LinkOutError: a link on the way leads out; the message names the link (relative to ``within``, else to
            ``root``) and its target.
    """
    found = escaping_link(root, relative, within=within)
    if found is not None and not _special(found[1]):
        link, target = found
        source = root if within is None else within
        if within is not None and (root / link).is_relative_to(within):  # named from the source, not the subfolder
            link = (root / link).relative_to(within).as_posix()
        raise LinkOutError(f"{quoted(link)} is a symlink to {quoted(str(target))}, outside the checkpoint "
                           f"{quoted(str(source))}; ckpttool follows no link out of the checkpoint. Copy the file "
                           "or folder in its place")
    return root / relative


def open_inside(root: Path, relative: str, label: str | None = None, *, within: Path | None = None) -> BinaryIO:
    """:func:`open_source` of ``root / relative`` (labelled ``relative``), refused when a link on the way leads
    out of the source (:func:`contained`)."""
    return open_source(contained(root, relative, within=within), relative if label is None else label)


def read_inside(root: Path, relative: str, label: str | None = None, *, limit: int | None = None,
                within: Path | None = None) -> bytes:
    """:func:`read_source` of ``root / relative`` (labelled ``relative``), refused when a link on the way leads
    out of the source (:func:`contained`)."""
    return read_source(contained(root, relative, within=within), relative if label is None else label, limit=limit)


def list_inside(root: Path, relative: str = "", *, within: Path | None = None) -> list[Path]:
    """The entries of the folder ``root / relative`` (sorted by name), refused when a link on the way to it leads
    out of the source (:func:`contained`). The entries themselves are not judged here: whatever is opened among
    them goes through :func:`open_inside`.

    Raises:
        SourceError: a link on the way leads out.
        OSError: the folder cannot be listed.
    """
    return sorted(contained(root, relative, within=within).iterdir()) if relative else sorted(root.iterdir())


def is_within(path: Path, ancestor: Path) -> bool:
    """True when ``path`` is ``ancestor`` or lies under it (both resolved)."""
    p, a = path.resolve(), ancestor.resolve()
    return p == a or a in p.parents


# ------------------------------------------------------------------------------------- reading source files

#: the most bytes of a metadata JSON file read (an index, a sidecar, a config); DeepSeek-V3's index is 9 MB
JSON_LIMIT = 256 * 2**20


def open_source(path: str | Path, label: str | None = None) -> BinaryIO:
    """``path`` opened for binary reading, when it is a regular file (after symlinks).

    A FIFO would block the reader forever and ``/dev/zero`` would never end: the file is opened without blocking
    and checked with ``fstat`` before anything is read. Every ``OSError`` becomes a :class:`SourceError` that names
    the file (``label``, else the path) and the system's reason.

    Raises:
        SourceError: no such file, not a regular file, or the system refuses to open it (permissions, I/O error).

    Example:
        >>> with open_source(root / "model.safetensors", "model.safetensors") as f:  # doctest: +SKIP
        ...     header_length = f.read(8)
    """
    shown = str(path) if label is None else label
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise source_os_error(shown, e) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise SourceError(f"'{shown}': not a regular file ({_kind(mode)}); ckpttool reads only regular files")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_source(path: str | Path, label: str | None = None, *, limit: int | None = None) -> bytes:
    """The bytes of a regular file (:func:`open_source`); with ``limit``, a file larger than that is refused
    unread beyond it (a metadata file is small; a huge one is not what it claims to be).

    Raises:
        SourceError: as :func:`open_source`; also an I/O error while reading, or the limit.
    """
    shown = str(path) if label is None else label
    with open_source(path, label) as f:
        try:
            data = f.read() if limit is None else f.read(limit + 1)
        except OSError as e:
            raise source_os_error(shown, e) from None
    if limit is not None and len(data) > limit:
        raise SourceError(
            f"'{shown}': larger than {limit} bytes, far more than such a file holds; is it the right file?")
    return data


def read_source_text(path: str | Path, label: str | None = None, *, limit: int | None = None) -> str:
    """:func:`read_source` decoded as UTF-8.

    Raises:
        UnicodeDecodeError: the bytes are not UTF-8 (the caller says what the file should hold).
    """
    return read_source(path, label, limit=limit).decode("utf-8")


def read_tag(path: str | Path, label: str | None = None, *, limit: int = 256) -> str | None:
    """The one short line a tag file holds (DeepSpeed's ``latest``, Megatron's tracker file), stripped; None when
    the file holds anything else. At most ``limit`` + 1 bytes are read, and a caller never shows what did not
    parse: the file may be a link to ``/etc/passwd``.

    Raises:
        SourceError: as :func:`open_source`.
    """
    shown = str(path) if label is None else label
    with open_source(path, label) as f:
        try:
            raw = f.read(limit + 1)
        except OSError as e:
            raise source_os_error(shown, e) from None
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None
    return tag if tag and len(raw) <= limit and tag.isprintable() else None


def is_regular(path: str | Path) -> bool:
    """True when ``path`` is a regular file (after symlinks); never opens it."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def source_os_error(label: str, error: OSError) -> SourceError:
    """The :class:`SourceError` for ``error`` on the source file ``label``: the file and the system's reason.

    Never a :class:`SourceNotFoundError`, which is an ``OSError`` too: callers wrap ``OSError`` of their own."""
    return SourceError(f"'{label}': cannot read: {error.strerror or type(error).__name__}")


def _special(path: Path) -> bool:
    """True when ``path`` is there and is neither a regular file nor a folder (a FIFO, a device, a socket)."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))
    return next((name for test, name in kinds if test(mode)), "not a plain file")
