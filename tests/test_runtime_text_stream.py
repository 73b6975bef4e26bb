"""The one stop-string rule (ktrun.text.text_stream.TextStream, used by generate(), the Engine and `ktrun serve`) and the
finish rule around it (ktrun.sequence.Sequence), on a byte-level tokenizer: one token per UTF-8 byte, decoded the way
byte-level BPE tokenizers decode (invalid or incomplete bytes -> U+FFFD).

The reference is plain string arithmetic on the full decode: the completion is the decoded text before the first
occurrence of any stop string, and the request ends at the first token whose decoded text contains one."""
from __future__ import annotations

import random

import pytest
from ktrun.sampling_params import SamplingParams
from ktrun.sequence import Sequence
from ktrun.text.text_stream import TextStream

EOS = 256   # a special token: decodes to nothing (skip_special_tokens)


def decode(ids) -> str:
    return bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")


def ids_of(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def run(text_or_ids, stop, prompt=b"> ") -> tuple[list[str], TextStream, int | None]:
    """Push every token, then finish(); -> (deltas, stream, index of the token at which it stopped)."""
    ids = ids_of(text_or_ids) if isinstance(text_or_ids, str) else list(text_or_ids)
    ts = TextStream(decode, stop, list(prompt))
    deltas, stopped_at = [], None
    for j, t in enumerate(ids):
        deltas.append(ts.push(t))
        if ts.stopped and stopped_at is None:
            stopped_at = j
    deltas.append(ts.finish())
    return deltas, ts, stopped_at


def test_no_stop_strings_streams_the_full_decode():
    deltas, ts, at = run("Grüße, 世界! 🙂 ok", [])
    assert "".join(deltas) == ts.text == "Grüße, 世界! 🙂 ok" and at is None and not ts.stopped


def test_multibyte_characters_never_streamed_in_pieces():
    text = "é世🙂x"                                    # 2, 3 and 4 bytes: one token each byte
    deltas, ts, _ = run(text, [])
    assert [d for d in deltas if d] == ["é", "世", "🙂", "x"] and ts.text == text
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_split_across_tokens_is_not_returned_nor_streamed_in_part():
    deltas, ts, at = run("hello STOP world", ["STOP"])
    assert "".join(deltas) == ts.text == "hello " and ts.stopped
    assert at == len("hello STOP") - 1                  # ends at the token that completes the stop string
    assert all("S" not in d for d in deltas)            # no part of the stop string was ever handed out


def test_held_back_prefix_is_released_once_it_is_not_a_stop_string():
    ts = TextStream(decode, ["STOP"])
    got = [ts.push(t) for t in ids_of("a ST")]
    assert "".join(got) == "a "                         # "ST" could start "STOP": held back
    assert ts.push(ord("x")) == "STx" and not ts.stopped
    assert ts.finish() == "" and ts.text == "a STx"
    ts = TextStream(decode, ["STOP"])                   # held back until the end: finish() hands it out
    assert "".join(ts.push(t) for t in ids_of("a STO")) == "a " and ts.finish() == "STO"


def test_earliest_of_several_stop_strings_wins():
    deltas, ts, at = run("one two three", ["three", "two", "@@"])
    assert "".join(deltas) == ts.text == "one " and at == len("one two") - 1


def test_multibyte_stop_string_split_across_byte_tokens():
    deltas, ts, at = run("Preis: 5€ und mehr", ["€ u", "🙂"])
    assert "".join(deltas) == ts.text == "Preis: 5" and at == len("Preis: 5€ u".encode()) - 1
    deltas, ts, at = run("x 世界 y", ["界"])           # stop string completed by the last byte of a character
    assert "".join(deltas) == ts.text == "x 世" and at == len("x 世界".encode()) - 1


def test_stop_string_seen_before_a_trailing_incomplete_character():
    """A token that completes the stop string and starts a multi-byte character (token 300 = "b" + the first byte
    of "é") stops the request at that token, though its text ends in an incomplete character."""
    vocab = {**{i: bytes([i]) for i in range(256)}, 300: b"b\xc3"}

    def decode_vocab(ids):
        return b"".join(vocab[t] for t in ids).decode("utf-8", errors="replace")

    ts = TextStream(decode_vocab, ["ab"])
    assert ts.push(ord("a")) == "" and not ts.stopped          # "a" could start "ab"
    assert ts.push(300) == "" and ts.stopped and ts.text == ""
    ts = TextStream(decode_vocab, ["bé"])                      # completed by the next token: shown, then cut
    assert ts.push(ord("a")) == "a" and ts.push(300) == "" and not ts.stopped
    assert ts.push(0xA9) == "" and ts.stopped and ts.text == "a"


def test_incomplete_character_at_the_end_is_flushed_by_finish():
    ts = TextStream(decode, [])
    assert ts.push(ord("a")) == "a" and ts.push(0xE4) == "" and ts.push(0xB8) == ""
    assert ts.finish() == "\ufffd" and ts.text == "a\ufffd" == decode([ord("a"), 0xE4, 0xB8])
    ts = TextStream(decode, ["zz"])                            # push(last=True): the same, in one call
    assert ts.push(ord("z")) == "" and ts.push(0xE4, last=True) == "z\ufffd" and not ts.stopped


def test_left_context_from_the_prompt_and_nothing_after_a_stop():
    ts = TextStream(decode, ["."], prompt_ids=ids_of("x\xc3"))   # prompt ends in half a character: not ours
    assert ts.push(ord("!")) == "!"
    assert ts.push(ord(".")) == "" and ts.stopped
    assert ts.push(ord("y")) == "" and ts.finish() == "" and ts.text == "!"


@pytest.mark.parametrize("seed", range(40))
def test_random_streams_match_string_arithmetic(seed):
    """Random byte streams mixing ASCII, multi-byte characters and stray bytes, against the reference."""
    rnd = random.Random(seed)
    pieces = ["a", "b", " ", "é", "€", "🙂", "世", "ab", "\n"]
    text = "".join(rnd.choice(pieces) for _ in range(40))
    ids = ids_of(text)
    if seed % 4 == 0:                                   # stray continuation / lead bytes: U+FFFD in the decode
        for _ in range(3):
            ids.insert(rnd.randrange(len(ids)), rnd.choice([0x80, 0xC3, 0xE2]))
    full = decode(ids)
    stops = [full[i: i + rnd.randint(1, 4)] for i in rnd.sample(range(len(full)), 2)] if seed % 3 else ["@@"]
    stops = [s for s in stops if "\ufffd" not in s] or ["@@"]
    deltas, ts, at = run(ids, stops, prompt=b"")
    hits = [i for i in (full.find(s) for s in stops) if i >= 0]
    assert ts.text == "".join(deltas) == (full[: min(hits)] if hits else full)
    want_at = next((j for j in range(len(ids)) if any(s in decode(ids[: j + 1]) for s in stops)), None)
    assert at == want_at
    shown = ""
    for d in deltas:                                    # what a client saw at each point: never a stop string
        shown += d
        assert not any(s in shown for s in stops) and full.startswith(shown)


class _Cache:
    """The one thing Sequence reads from a KV cache: how many tokens it holds."""
    def __init__(self, n: int):
        self.length = n


def _finish(tokens, params, ctx=100, eos=frozenset({EOS}), prompt=(65, 66), decode_fn=decode):
    """Append tokens one by one (the cache holds the prompt and the previous tokens, as after each forward)."""
    cache = _Cache(len(prompt))
    seq = Sequence(list(prompt), params, cache, ctx, set(eos), decode_fn)
    text = ""
    for t in tokens:
        text += seq.append(t)
        if seq.finish_reason:
            break
        cache.length += 1
    return seq, text


def test_sequence_finish_rule():
    seq, text = _finish(ids_of("hi STOP no"), SamplingParams(max_tokens=50, stop=["STOP"]))
    assert (seq.finish_reason, text, len(seq.tokens)) == ("stop", "hi ", len("hi STOP"))
    seq, text = _finish([ord("a"), EOS, ord("b")], SamplingParams(max_tokens=50))
    assert (seq.finish_reason, text, seq.tokens) == ("stop", "a", [ord("a"), EOS])        # EOS
    seq, _ = _finish([ord("a"), EOS, ord("b")], SamplingParams(max_tokens=3, ignore_eos=True))
    assert (seq.finish_reason, len(seq.tokens)) == ("length", 3)                          # max_tokens
    seq, _ = _finish(ids_of("abcdef"), SamplingParams(max_tokens=50), ctx=5, prompt=(65, 66))
    assert (seq.finish_reason, len(seq.tokens)) == ("length", 3)                          # 2 + 3 fill ctx 5
    seq, _ = _finish(ids_of("x STOP"), SamplingParams(max_tokens=6, stop=["STOP"]), decode_fn=None)
    assert (seq.finish_reason, seq.text, len(seq.tokens)) == ("length", None, 6)         # no text: no stop


def test_sequence_stops_on_the_text_of_an_incomplete_last_character():
    """The rule sees the decoded text as it stands, incomplete last character (U+FFFD) included, as a full decode
    would: the stop string "a\ufffd" ends the request at the token that makes it appear, the text before it."""
    seq, text = _finish([ord("x"), ord("a"), 0xC3, ord("y")], SamplingParams(max_tokens=10, stop=["a\ufffd"]))
    assert (seq.finish_reason, text, len(seq.tokens)) == ("stop", "x", 3)
