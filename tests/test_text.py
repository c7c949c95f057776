"""A row's text as every door gives it (`tfgpt2.decoding.text`): `TextStream` (whole characters,
nothing a stop string may still claim, log-probability entries with the text they start in)
and `kept` (how the step's end of a row cuts its tokens and text), against the one-shot
decoding of the tokens. No TensorFlow model."""
import random

import pytest

from tfgpt2.decoding import step
from tfgpt2.decoding.text import TextStream, completion, kept, token_text
from tfgpt2.encoder import default_encoder

ENCODER = default_encoder()
WORD = ENCODER.encoding.decode_single_token_bytes
MULTIBYTE = ENCODER.encode("東京🙂 é ☃")  # byte-level tokens: most pairs of them are no whole character


def pieces_of(stream, tokens, cuts, finish=0, cut=0):
    """The text `stream` releases for `tokens` fed in groups split at `cuts`, the last group
    given to `finish` with the step's end of the row."""
    out, start = [], 0
    for end in cuts:
        out.append(stream.feed(tokens[start:end])[0])
        start = end
    out.append(stream.finish(tokens[start:], None, finish, cut)[0])
    return out


@pytest.mark.parametrize("seed", range(20))
def test_text_stream_joins_to_the_whole_decoding(seed):
    """Tokens of partial characters (and invalid bytes) fed in any grouping: no piece ends in
    the middle of a character, and the pieces join to the one-shot decoding of every token."""
    rng = random.Random(seed)
    tokens = [rng.choice(MULTIBYTE + ENCODER.encode(" a b")) for _ in range(rng.randint(1, 30))]
    cuts = sorted(rng.sample(range(len(tokens)), rng.randint(0, len(tokens) - 1)))
    pieces = pieces_of(TextStream(WORD), tokens, cuts)
    assert "".join(pieces) == ENCODER.decode(tokens)
    assert all("\ufffd" not in piece for piece in pieces[:-1]) or "\ufffd" in ENCODER.decode(tokens)


@pytest.mark.parametrize("seed", range(20))
def test_text_stream_never_releases_what_a_stop_string_may_claim(seed):
    """Fed a row whose text holds a stop string (the step ends it where the string completes,
    with the bytes to cut), the pieces join to the text before the first one, and no piece
    released before the end holds a part of it (OpenAI's rule on the text, streamed)."""
    rng = random.Random(seed)
    words = ENCODER.encode(" the cat sat on the mat, the end")
    stops = rng.sample(["the end", " mat,", "at", "t t", "cat sat", "e m"], 2)
    tokens, text = [], ""
    while not any(s in text for s in stops) and len(tokens) < 40:
        tokens.append(rng.choice(words))
        text = ENCODER.decode(tokens)
    if not any(s in text for s in stops):
        pytest.skip("no stop string in this draw")
    start = min(i for i in (text.find(s) for s in stops) if i >= 0)
    cut = len(text.encode()) - len(text[:start].encode())
    cuts = sorted(rng.sample(range(len(tokens)), rng.randint(0, len(tokens) - 1)))
    pieces = pieces_of(TextStream(WORD, stops), tokens, cuts, step.STOP_TEXT, cut)
    assert "".join(pieces) == text[:start]
    released = "".join(pieces[:-1])
    assert not any(s[:n] and released.endswith(s[:n]) and start == len(released) - n
                   for s in stops for n in range(1, len(s)))


def test_kept_ends_a_row_as_the_step_says():
    """<|endoftext|> that ended a row is in neither its tokens nor its text; a stop token
    sequence is left out; a stop string cuts the text at a byte (inside a token too), and the
    tokens are those wholly before it."""
    tokens = ENCODER.encode(" NETWORK of cats")
    assert kept(tokens + [ENCODER.eot_token], step.EOT, 0, WORD) == (tokens, ENCODER.decode(tokens).encode())
    assert kept(tokens, step.STOP, 2, WORD)[0] == tokens[:-2]
    whole = ENCODER.decode(tokens).encode()
    new, data = kept(tokens, step.STOP_TEXT, len(whole) - 2, WORD)  # " N|ETWORK": the stop "ETW" in the first token
    assert data == b" N" and new == []
    done = completion([1], tokens, step.STOP_TEXT, len(whole) - len(b" NETWORK of"), WORD,
                      scores=[(-1.0, [5], [-1.0])] * len(tokens))
    assert done.text == " NETWORK of" and done.finish_reason == "stop" and done.new_tokens.tolist() == tokens[:2]
    assert len(done.logprobs) == 2 and done.tokens.tolist() == [1] + tokens[:2]


def test_text_stream_releases_log_probability_entries_with_their_text():
    """Each token's entry comes with the text it starts in, offsets counted after an echoed
    prompt; tokens cut off by a stop string have none."""
    tokens = ENCODER.encode(" one two three four")
    stream = TextStream(WORD, [" three"], offset=5)
    entries = [{"token": ENCODER.decode([t])} for t in tokens]
    text, released = stream.finish(tokens[:3], entries[:3], step.STOP_TEXT, len(" three"))
    assert text == " one two"
    assert [(e["token"], e["offset"]) for e in released] == [(" one", 5), (" two", 9)]
    assert token_text(b"\xe6\x9d") == "bytes:\\xe6\\x9d" and token_text(b" a") == " a"
