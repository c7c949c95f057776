"""A row's tokens as the text every door shows (`Completion`, `TextStream`): the UTF-8 of its
tokens' bytes, where a row that the step ended (`step.finish`) ends as the step says: without
the <|endoftext|> that ended it, without a stop token sequence, and before a stop string (the
step's `cut`: bytes from the end of the text). Streamed, no piece ends inside a character or
holds bytes that a stop string may still claim."""
import codecs
import dataclasses

import numpy as np

from . import step as per_token


@dataclasses.dataclass
class Completion:
    """A generated row: `tokens` (the prompt, then the new tokens whose text is `text`), `text`
    (the new text), `finish_reason` ("stop": a stop or end-of-text; "length"), and, where asked,
    `logprobs` (per new token of `tokens`: its log-probability and the most likely [(id,
    log-probability)], `step.log_probabilities`) and `prompt_logprobs` (per prompt token after
    the first, the same)."""
    tokens: np.ndarray
    text: str
    finish_reason: str
    logprobs: list = None
    prompt_logprobs: list = None

    @property
    def new_tokens(self):
        return self.tokens[len(self.tokens) - self.count:] if self.count else self.tokens[:0]

    count: int = 0  # new tokens in `tokens`


def token_row(new, finish, cut):
    """A row's new tokens as `tfgpt2.generate` returns them without text: through the
    end-of-text that ended it, without a stop token sequence that ended it."""
    return list(new[:len(new) - cut]) if finish == per_token.STOP else list(new)


def kept(new, finish, cut, token_bytes):
    """(the new tokens that the text holds, the text's bytes) of a row's new tokens `new`,
    ended by `finish` with `cut` (`step`)."""
    new = list(new)
    if finish == per_token.EOT:
        new = new[:-1]
    if finish == per_token.STOP:
        new = new[:len(new) - cut]
    data = b"".join(token_bytes(t) for t in new)
    if finish == per_token.STOP_TEXT:
        data, whole = data[:len(data) - cut], 0
        for n, token in enumerate(new):
            whole += len(token_bytes(token))
            if whole > len(data):
                new = new[:n]
                break
    return new, data


def completion(prompt, new, finish, cut, token_bytes, *, scores=None, prompt_scores=None):
    """The `Completion` of a row: its prompt, its new tokens `new` (through the one that ended
    it), `finish` and `cut` (`step`); `scores`: per new token (log-probability, top ids, their
    log-probabilities), where asked."""
    tokens, data = kept(new, finish, cut, token_bytes)
    return Completion(np.concatenate([np.asarray(prompt, np.int32), np.asarray(tokens, np.int32)]),
                      data.decode("utf-8", errors="replace"),
                      "length" if finish in (0, per_token.LENGTH) else "stop",
                      None if scores is None else [_entry(s) for s in scores[:len(tokens)]],
                      None if prompt_scores is None else [_entry(s) for s in prompt_scores], count=len(tokens))


def _entry(score):
    logprob, ids, values = score
    return float(logprob), [(int(t), float(v)) for t, v in zip(ids, values)]


class TextStream:
    """The text of a row as its tokens arrive: `feed` its new tokens (with their log-probability
    entries, where asked) while it runs, then `finish` with its last ones and how the step ended
    it; each returns the text that can be released and the entries that start in it.
    `token_bytes(id)` gives a token's bytes; `stops` (the row's stop strings) hold back the end
    of the text while it may begin one; `offset`: the characters before this text (an echoed
    prompt), for the entries' offsets."""

    def __init__(self, token_bytes, stops=(), *, offset=0, errors="replace"):
        self.token_bytes, self.stops = token_bytes, [s.encode("utf-8") for s in stops if s]
        self.decoder, self.counter = (codecs.getincrementaldecoder("utf-8")(errors=errors) for _ in range(2))
        self.data, self.tokens, self.sent, self.text = b"", [], 0, ""
        self.offset, self.chars = offset, 0  # the characters before this text, and in all the bytes fed
        self.entries, self.released = [], 0

    def feed(self, tokens, entries=None):
        """Add new tokens of a row still running; returns (the text now released, its entries)."""
        self._add(tokens, entries)
        return self._release(len(self.data) - self._held())

    def finish(self, tokens=(), entries=None, finish=0, cut=0):
        """Add the row's last tokens, then release the rest of the text as `step` ended the row
        (`finish`, `cut`; bytes that form no character as U+FFFD) and the entries of the tokens
        it keeps."""
        self._add(tokens, entries)
        kept_tokens, self.data = kept(self.tokens, finish, cut, self.token_bytes)
        del self.entries[len(kept_tokens):]
        return self._release(len(self.data), final=True)

    def _add(self, tokens, entries):
        for n, token in enumerate(tokens):
            if entries is not None:  # where the token's first byte is, in characters
                self.entries.append(dict(entries[n], offset=self.offset + self.chars))
            self.tokens.append(token)
            data = self.token_bytes(token)
            self.data += data
            self.chars += len(self.counter.decode(data))

    def _release(self, end, final=False):
        piece = self.decoder.decode(self.data[self.sent:max(end, self.sent)], final=final)
        self.sent = max(self.sent, end)
        self.text += piece
        limit = self.offset + len(self.text)
        entries = [e for e in self.entries[self.released:] if final or e["offset"] < limit]
        self.released += len(entries)
        return piece, entries

    def _held(self):
        """How many bytes at the end of the text may begin a stop string."""
        for n in range(min(len(self.data), max(map(len, self.stops), default=1) - 1), 0, -1):
            if any(s.startswith(self.data[-n:]) for s in self.stops):
                return n
        return 0


def token_text(token_bytes):
    """A token as OpenAI's logprobs show it: its text, or "bytes:\\xNN..." where its bytes are no
    whole UTF-8 text."""
    try:
        return token_bytes.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in token_bytes)
