"""stream_text: deltas hold back partial characters and possible stop-string starts."""

from __future__ import annotations

from core.jobs import SamplingParams
from workers.engines.base import EngineRequest
from workers.engines.decoding import stream_text


class CharEngine:
    """Token i is chr(i); 0 decodes to an unfinished multi-byte character."""

    eos_ids = [2]

    def decode(self, ids: list[int]) -> str:
        return "".join("\ufffd" if i == 0 else chr(i) for i in ids)


def run(tokens: list[int], stop: list[str]) -> list[str]:
    sent: list[str] = []
    r = EngineRequest(job_id="j", prompt_ids=[], sampling=SamplingParams(stop=stop), on_text=sent.append)
    for t in tokens:
        r.tokens.append(t)
        stream_text(CharEngine(), r)
    return sent


def test_deltas_add_up_to_the_text():
    assert "".join(run([ord(c) for c in "hello"], [])) == "hello"


def test_a_partial_character_waits():
    assert run([ord("a"), 0], []) == ["a"]


def test_a_possible_stop_string_start_is_held_back_and_never_sent_once_complete():
    sent = run([ord(c) for c in "one, two, three"], [", thr"])
    assert "".join(sent) == "one, two"
