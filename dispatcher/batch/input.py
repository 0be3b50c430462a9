"""A batch input file as people really produce it → its lines, streamed.

Files arrive gzipped (``.jsonl.gz``), saved as UTF-16 by Excel's "Unicode Text" or a
Windows editor, with CRLF endings, cut short by an interrupted upload, or with one line of
many megabytes. Each of those is read here, a line at a time and never whole; what cannot
be read becomes a ``LineProblem`` for the one line it hits (validation turns it into that
line's error record and the other lines run). A file that is not text at all (an Excel
workbook, a zip) is refused before anything is stored, naming what it looks like.
"""

from __future__ import annotations

import codecs
import gzip
import io
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

READ_CHUNK = 1 << 20

# The first bytes of files that are not JSON Lines, with what to tell the user.
NOT_TEXT = {
    b"PK\x03\x04": "a ZIP archive (an Excel .xlsx workbook?)",
    b"\xd0\xcf\x11\xe0": "an Excel 97-2003 .xls workbook",
    b"%PDF": "a PDF document",
    b"BZh": "a bzip2 archive",
    b"\xfd7zXZ": "an xz archive",
    b"(\xb5/\xfd": "a zstd archive",
}
GZIP_MAGIC = b"\x1f\x8b"
UTF16_BOMS = (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)


class NotJsonLinesError(ValueError):
    """The whole input is something other than (gzipped) JSON Lines text."""


@dataclass(frozen=True)
class LineProblem:
    """A line that could not be read as bytes of text; becomes that line's error record."""

    code: str
    message: str  # completes "line N ..."


def sniff(head: bytes) -> str | None:
    """What the input looks like, if it is not text; None for text (or gzip)."""
    for magic, what in NOT_TEXT.items():
        if head.startswith(magic):
            return what
    return None


def read_lines(raw: IO[bytes], max_line_bytes: int) -> Iterator[bytes | LineProblem]:
    """Lines of ``raw`` as UTF-8 bytes (their endings kept), ungzipped and re-encoded from
    UTF-16 when the file starts that way. A line over ``max_line_bytes`` is skipped
    without being held and reported; a gzip stream cut short ends with a problem line."""
    src = _peekable(raw)
    head = src.peek(8)[:8]
    what = sniff(head)
    if what:
        raise NotJsonLinesError(
            f"the input is {what}, not JSON Lines: save one JSON request per line as UTF-8 text (.jsonl or .jsonl.gz)"
        )
    if head.startswith(GZIP_MAGIC):
        src = gzip.GzipFile(fileobj=src, mode="rb")
    try:
        if src.peek(2)[:2] in UTF16_BOMS:
            yield from _utf16_lines(src, max_line_bytes)
        else:
            yield from _byte_lines(src, max_line_bytes)
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        yield LineProblem(
            "truncated_input",
            f"is where the gzip stream breaks off ({exc}): the file was cut short; upload it again",
        )


def _peekable(raw: IO[bytes]) -> IO[bytes]:
    """A stream with ``peek`` (files opened by path have it; some fsspec files do not)."""
    return raw if hasattr(raw, "peek") else io.BufferedReader(raw)  # type: ignore[arg-type]


def _byte_lines(src: IO[bytes], max_line_bytes: int) -> Iterator[bytes | LineProblem]:
    while line := src.readline(max_line_bytes + 1):
        if len(line) > max_line_bytes and not line.endswith(b"\n"):
            skipped = len(line) + _skip_rest(src)
            yield _too_long(skipped, max_line_bytes)
        else:
            yield line


def _skip_rest(src: IO[bytes]) -> int:
    """Read past the rest of an over-long line, a chunk at a time; returns bytes skipped."""
    skipped = 0
    while chunk := src.readline(READ_CHUNK):
        skipped += len(chunk)
        if chunk.endswith(b"\n"):
            break
    return skipped


def _utf16_lines(src: IO[bytes], max_line_bytes: int) -> Iterator[bytes | LineProblem]:
    text = io.TextIOWrapper(src, encoding="utf-16", errors="strict", newline=None)  # type: ignore[arg-type]
    max_chars = max_line_bytes // 2
    try:
        while line := text.readline(max_chars + 1):
            if len(line) > max_chars and not line.endswith("\n"):
                skipped = len(line)
                while (rest := text.readline(READ_CHUNK)) and not rest.endswith("\n"):
                    skipped += len(rest)
                yield _too_long(2 * skipped, max_line_bytes)
            else:
                yield line.encode("utf-8")
    except UnicodeDecodeError as exc:
        yield LineProblem("invalid_utf16", f"is not valid UTF-16 ({exc.reason}): save the file as UTF-8")


def _too_long(size: int, limit: int) -> LineProblem:
    return LineProblem(
        "line_too_long",
        f"is {size / 1e6:.1f} MB, over the {limit / 1e6:.1f} MB a line may be (batch.max_line_bytes)",
    )
