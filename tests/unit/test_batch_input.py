"""Batch input files as people produce them: gzip, UTF-16 from Excel, CRLF, a truncated
upload, a line of many megabytes, a workbook instead of text (dispatcher.batch.input)."""

from __future__ import annotations

import codecs
import gzip
import io
import json
import tracemalloc

import pytest

from core.registry import ModelRegistry
from dispatcher.batch.format import LineError, ParsedLine, parse_line
from dispatcher.batch.input import LineProblem, NotJsonLinesError, read_lines

MODEL = "smollm2-135m"
LINES = [json.dumps({"custom_id": f"r{i}", "prompt": f"café {i}", "model": MODEL}) for i in range(3)]
TEXT = "".join(line + "\n" for line in LINES)


@pytest.fixture(scope="module")
def registry():
    return ModelRegistry.from_config()


def read(data: bytes, limit: int = 1 << 20) -> list[bytes | LineProblem]:
    return list(read_lines(io.BytesIO(data), limit))


def test_plain_gzipped_and_utf16_files_give_the_same_utf8_lines():
    plain = read(TEXT.encode())
    assert [json.loads(x)["prompt"] for x in plain] == ["café 0", "café 1", "café 2"]
    assert read(gzip.compress(TEXT.encode())) == plain
    # Excel's "Unicode Text" and Windows editors: UTF-16 LE with a byte-order mark, CRLF.
    excel = codecs.BOM_UTF16_LE + TEXT.replace("\n", "\r\n").encode("utf-16-le")
    assert read(excel) == plain
    assert read(codecs.BOM_UTF16_BE + TEXT.encode("utf-16-be")) == plain


def test_a_gzip_cut_short_keeps_its_whole_lines_and_ends_with_one_problem_line():
    data = gzip.compress((TEXT * 200).encode())
    got = read(data[: len(data) // 2])
    assert all(isinstance(x, bytes) for x in got[:-1]) and len(got) > 10
    assert isinstance(got[-1], LineProblem) and got[-1].code == "truncated_input"


def test_a_line_over_the_limit_is_one_problem_and_is_never_held_whole():
    huge = b'{"custom_id": "big", "prompt": "' + b"x" * 10_000_000 + b'"}\n'
    src = io.BufferedReader(io.BytesIO(LINES[0].encode() + b"\n" + huge + LINES[1].encode() + b"\n"))
    tracemalloc.start()
    got = list(read_lines(src, 1 << 20))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert [type(x) for x in got] == [bytes, LineProblem, bytes]
    assert got[1].code == "line_too_long" and "10.0 MB" in got[1].message
    assert peak < 6_000_000  # a 1 MiB window and 1 MiB chunks (about 4 MB measured), not the 10 MB line


@pytest.mark.parametrize(
    ("head", "what"), [(b"PK\x03\x04rest", "xlsx"), (b"\xd0\xcf\x11\xe0\xa1\xb1", ".xls"), (b"%PDF-1.7", "PDF")]
)
def test_a_workbook_or_document_instead_of_text_is_refused_naming_what_it_is(head, what):
    with pytest.raises(NotJsonLinesError, match=what):
        read(head + b"\x00" * 100)


def test_a_problem_line_becomes_that_lines_error_record(registry):
    err = parse_line(4, LineProblem("line_too_long", "is 10.0 MB"), registry, {}, set())
    assert isinstance(err, LineError) and err.code == "line_too_long" and err.message == "line 4 is 10.0 MB"


@pytest.mark.parametrize(
    ("raw", "code", "hint"),
    [
        (b'{"custom_id": "t", "prompt": "cut', "invalid_json", "truncated upload"),  # the last line, no newline
        (b'"{""custom_id"": ""a"", ""prompt"": ""Hi""}"\r\n', "invalid_json", "spreadsheet cell"),  # Excel CSV
        (b'{\x00"\x00c\x00}\x00\n', "invalid_json", "NUL bytes"),
        (b"[" * 100_000 + b"\n", "invalid_json", "nests too deeply"),
        (b'{"custom_id": "n", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}\n", "invalid_json", "digits"),
        (b'{"custom_id": "s", "prompt": "a\\ud800b", "model": "smollm2-135m"}\n', "invalid_text", "surrogate"),
    ],
)
def test_lines_people_produce_get_an_error_naming_the_cause_not_an_exception(registry, raw, code, hint):
    err = parse_line(2, raw, registry, {}, set())
    assert isinstance(err, LineError) and err.code == code and err.line == 2
    assert hint in err.message


def test_a_valid_line_without_its_final_newline_still_parses(registry):
    p = parse_line(3, LINES[0].encode(), registry, {}, set())
    assert isinstance(p, ParsedLine) and json.loads(p.payload)["prompt"] == "café 0"


def test_short_jobs_are_cleared_by_their_bytes_without_a_tokenizer():
    from core.jobs import GenerationJob
    from dispatcher.routing.context import might_overflow

    short = GenerationJob(model=MODEL, prompt="x" * 1000, sampling={"max_tokens": 16})
    assert not might_overflow(short, 2048)
    assert might_overflow(
        short.model_copy(update={"sampling": short.sampling.model_copy(update={"max_tokens": 1100})}), 2048
    )
    chat = GenerationJob(model=MODEL, messages=[{"role": "user", "content": "é" * 300}], sampling={"max_tokens": 16})
    assert not might_overflow(chat, 2048) and might_overflow(chat, 1024 + 256 + 600 + 16 - 1)
