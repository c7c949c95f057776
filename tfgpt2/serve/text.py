"""The text of a completion as its tokens arrive (`TextStream`): whole UTF-8 characters only,
stop strings matched on the text (OpenAI's rule: the text ends before the first one, which is
left out), and nothing released that a stop string may still claim. The pieces it releases,
joined, are the completion's text, streamed or not."""
import codecs


class TextStream:
    """Feed it a sequence's new tokens (`feed`), then `finish`; each returns the text that can
    be released, and `feed` whether a stop string ended the text. `token_bytes(id)` gives a
    token's bytes. With `logprobs`, each token's entry (its text, offset in the text and
    log-probabilities, `entry`) is released with the text it starts in."""

    def __init__(self, token_bytes, stops=(), *, offset=0, errors="replace"):
        self.token_bytes, self.stops = token_bytes, [s for s in stops if s]
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors=errors)
        self.text, self.sent, self.checked = "", 0, 0
        self.offset = offset  # the text before this one (an echoed prompt), for the entries' offsets
        self.entries, self.released = [], 0
        self.stopped = False

    def feed(self, tokens, logprobs=None):
        """Add tokens (with their log-probability entries, `entry`, where asked); returns
        (the text to release, its entries, whether a stop string ended the text)."""
        for n, token in enumerate(tokens):
            if logprobs is not None:
                self.entries.append(dict(logprobs[n], offset=self.offset + len(self.text)))
            self.text += self.decoder.decode(self.token_bytes(token))
        return self._release(final=False)

    def finish(self):
        """The rest of the text (trailing bytes that form no character as U+FFFD) and entries."""
        if not self.stopped:
            self.text += self.decoder.decode(b"", final=True)
        return self._release(final=True)[:2]

    def _release(self, final):
        if not self.stopped:
            self._find_stop()
        end = len(self.text) if final or self.stopped else len(self.text) - self._held()
        piece, self.sent = self.text[self.sent:end], max(self.sent, end)
        limit = self.offset + (len(self.text) if final and not self.stopped else self.sent)
        entries = [e for e in self.entries[self.released:] if e["offset"] < limit or (final and not self.stopped)]
        self.released += len(entries)
        return piece, entries, self.stopped

    def _find_stop(self):
        """Cut the text before the first stop string in it, if any (searching only where one
        could have been completed since the last search)."""
        longest = max(map(len, self.stops), default=0)
        start = max(0, self.checked - longest + 1)
        found = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        self.checked = len(self.text)
        if found:
            self.text, self.stopped = self.text[:min(found)], True

    def _held(self):
        """How many characters at the end of the text may begin a stop string."""
        for n in range(min(len(self.text), max(map(len, self.stops), default=1) - 1), 0, -1):
            if any(s.startswith(self.text[-n:]) for s in self.stops):
                return n
        return 0


def token_text(token_bytes):
    """A token as OpenAI's logprobs show it: its text, or "bytes:\\xNN..." where its bytes are no
    whole UTF-8 text."""
    try:
        return token_bytes.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in token_bytes)
