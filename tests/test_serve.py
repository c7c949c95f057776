"""`tfgpt2 serve` (`tfgpt2.serve`) driven with the official `openai` client and plain HTTP: one
server for the module, a child process on the tiny model (n_ctx 64) with 4 slots and an API key,
whose answers are held to `tfgpt2.generate` on each prompt alone (in this process), the text
streams to the one-shot decoding of their tokens, and log-probabilities to NumPy's over the
model's logits; hostile and slow clients meet its limits while it serves others. The SIGTERM
test ends a server of its own (`Servers.alone`), so the tests pass in any order."""
import asyncio
import collections
import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from unittest import mock

import httpx
import numpy as np
import openai
import pytest

from tests.helpers import ROOT, free_port
from tfgpt2.encoder import default_encoder
from tfgpt2.decoding.text import token_text

pytestmark = pytest.mark.own_process  # its programs compiled in a process of its own (tests/own_process.py)

SLOTS, QUEUE = 4, 12  # 16 completions at once: 4 running, 12 waiting
NEW = 12  # new tokens: with prompts of <= 16 tokens, one compiled program here and one window there
ENCODER = default_encoder()
MULTIBYTE = ENCODER.encode("東京🙂 é ☃")  # byte-level tokens: most pairs of them are no whole character
PROMPTS = ["Every effort moves you", "naïve café, 東京 🙂 — déjà vu", "Ünïcödé ☃ snowman", "The quick brown fox",
           "Hello, world!", "Once upon a time", "1 2 3 4 5", "¿Qué tal?", "Ελληνικά", "日本語のテキスト", "def main():",
           "<|endoftext|>Hi", "A b", "It was the best of times", "Καλημέρα", "emoji 🎉🎉"]  # 2 to 16 tokens each


# ---- the server ---------------------------------------------------------------------------------

KEY = "tfgpt2-test-key"  # the server's API key, given in its environment (TFGPT2_API_KEY), not its command line
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT, TIMEOUT, DRAIN = 1_000_000, 3, 5  # the server's --max_body_bytes, --request_timeout, --drain_timeout
EOT_BANNED = {str(ENCODER.eot_token): -100}
LONG = dict(model="tiny", prompt=[1], max_tokens=10**6, stream=True, context_keep=32, logit_bias=EOT_BANNED)
"""A completion that runs until its client leaves or the server cuts it off (a million tokens)."""

Server = collections.namedtuple("Server", "url child log")


class Servers:
    """`tfgpt2 serve` on the tiny model in a child process (4 slots, 12 places in the queue, the
    limits above), shared by the module's tests (`get`, started again where one ended), and
    servers of one test's own (`alone`, with flags of its own), all stopped with the module."""

    def __init__(self, model_dir, folder):
        self.model_dir, self.folder, self.current, self.others = model_dir, folder, None, []

    def get(self):
        if self.current is None or self.current.child.poll() is not None:
            if self.current is not None:
                self._stop(self.current)
            self.current = self._start()
        return self.current

    def alone(self, *flags):
        """A server of the caller's own, with `flags` added (the SIGTERM test ends it)."""
        self.others.append(self._start(*flags))
        return self.others[-1]

    def _start(self, *extra):
        port, log = free_port(), self.folder / f"stderr-{time.monotonic_ns()}"
        env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2", TFGPT2_API_KEY=KEY)
        flags = dict(model_dir=self.model_dir, port=port, max_batch=SLOTS, max_queue=QUEUE, prefill_chunk=16,
                     max_body_bytes=LIMIT, request_timeout=TIMEOUT, drain_timeout=DRAIN)
        with open(log, "w") as stderr:
            child = subprocess.Popen([sys.executable, "-m", "tfgpt2.cli.main", "serve", "--quiet"] + [
                f"--{k}={v}" for k, v in flags.items()] + list(extra), cwd=ROOT, env=env, stderr=stderr, text=True)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and child.poll() is None:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    return Server(url, child, log)
            except httpx.TransportError:
                time.sleep(0.2)
        child.kill()
        pytest.fail(f"the server did not answer /health (exit status {child.wait()}): {log.read_text()[-3000:]}")

    def stop(self):
        for server in filter(None, [self.current, *self.others]):
            self._stop(server)
        self.current, self.others = None, []

    @staticmethod
    def _stop(server):
        if server.child.poll() is None:
            server.child.kill()
        server.child.wait()
        sys.stderr.write(server.log.read_text()[-5000:])


@pytest.fixture(scope="module")
def servers(tiny_dir, tmp_path_factory):
    started = Servers(tiny_dir, tmp_path_factory.mktemp("serve"))
    yield started
    started.stop()


@pytest.fixture
def server(servers):
    """The module's server, running: (base URL, process, the path of its stderr)."""
    return servers.get()


@pytest.fixture
def client(server):
    return client_of(server)


def client_of(server):
    """The `openai` client of `server`, with the key, no retries (no failure hides) and a
    connection per request (`Connection: close`): the server closes a connection left idle for
    --request_timeout (3 s here), and a request sent on a kept one as it closes meets a reset."""
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120,
                         default_headers={"Connection": "close"})


class Reader(threading.Thread):
    """A streamed completion read in a thread: each `data:` line with the time it arrived
    (`lines`), `first` set at the first; `close` leaves (the client disconnects)."""

    def __init__(self, url, body):
        super().__init__(daemon=True)
        self.url, self.body, self.lines = url, body, []
        self.first, self.leave = threading.Event(), threading.Event()
        self.start()

    def run(self):
        with httpx.stream("POST", self.url + "/v1/completions", json=self.body, headers=AUTH, timeout=120) as answer:
            for line in answer.iter_lines():
                if line.startswith("data: "):
                    self.lines.append((time.monotonic(), line))
                    self.first.set()
                if self.leave.is_set():
                    return

    def close(self):
        self.leave.set()
        self.join(timeout=120)
        assert not self.is_alive()


def until(condition, timeout=60):
    """Wait until `condition()` holds (checked every 20 ms), at most `timeout` seconds; whether it held."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def alone(model, prompt, length=NEW, **kwargs):
    """`tfgpt2.generate` on the prompt alone, as the server's text (<|endoftext|> ends it, unshown)."""
    from tfgpt2.sample import generate
    ids = ENCODER.encode(prompt, allowed_special="all") if isinstance(prompt, str) else prompt
    new = generate(model, [ids], length, stop_at_eot=True, **kwargs)[0][len(ids):].tolist()
    return ENCODER.decode(new[:-1] if new and new[-1] == ENCODER.eot_token else new)


def streamed(client, **request):
    """A streamed completion's chunks: (each choice's joined text, finish reasons, the chunks)."""
    chunks = list(client.completions.create(model="tiny", stream=True, **request))
    texts, reasons = {}, {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
    return texts, reasons, chunks


@pytest.mark.slow
def test_models_and_health(server, client):
    """The model's list and object (`client.models.retrieve`), another id a 404; /health needs
    no key."""
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-4")
    assert caught.value.code == "model_not_found" and caught.value.param == "model"
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.slow
def test_greedy_completions_plain_and_streamed_are_generate_alone(client, tiny):
    """At temperature 0 each choice is `tfgpt2.generate`'s text for its prompt alone, multi-byte
    characters split across tokens included (`logit_bias` makes the model write byte tokens),
    and a streamed completion's chunks join to the same text."""
    from tfgpt2.serve.scheduler import LONE_STEPS
    bias = {str(t): 100 for t in MULTIBYTE}
    for prompt, extra in [(PROMPTS[0], {}), (PROMPTS[1], {}), (PROMPTS[2], dict(logit_bias=bias))]:
        expected = alone(tiny, prompt, temperature=0, logit_bias={int(t): v for t, v in extra.get("logit_bias",
                                                                                               {}).items()})
        plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=NEW, temperature=0, **extra)
        texts, reasons, chunks = streamed(client, prompt=prompt, max_tokens=NEW, temperature=0, **extra)
        assert plain.choices[0].text == texts[0] == expected, prompt
        # streamed as it is made: a chunk per decode call (its first token's own, then up to LONE_STEPS
        # tokens a call for a completion alone)
        assert len(chunks) >= 1 + -(-(NEW - 1) // LONE_STEPS) > 1 and plain.choices[0].finish_reason == reasons[0]
        assert plain.usage.prompt_tokens == len(ENCODER.encode(prompt, allowed_special="all"))
    # the bytes of characters came in several tokens, whole (and where no character, as U+FFFD)
    assert "\ufffd" in expected and any(len(c.encode()) > 1 and c != "\ufffd" for c in expected)


@pytest.mark.slow
def test_a_list_of_prompts_n_choices_and_echo(client, tiny):
    """Prompts as a list of strings and as token ids, n=2 choices each (greedy: equal), echo."""
    ids = ENCODER.encode(PROMPTS[3])
    out = client.completions.create(model="tiny", prompt=[PROMPTS[4], PROMPTS[5]], n=2, max_tokens=NEW,
                                    temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [alone(tiny, PROMPTS[4], temperature=0)] * 2 + [
        alone(tiny, PROMPTS[5], temperature=0)] * 2
    echoed = client.completions.create(model="tiny", prompt=[ids], max_tokens=NEW, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPTS[3] + alone(tiny, ids, temperature=0)
    assert out.usage.completion_tokens == 4 * NEW or any(c.finish_reason == "stop" for c in out.choices)


@pytest.mark.slow
def test_sixteen_concurrent_clients_each_get_their_answer_alone(client, tiny):
    """16 clients at once over 4 slots (the rest queued, prefilled between steps): each greedy
    answer is its prompt's alone, and each seeded one is `tfgpt2.generate`'s with that seed."""
    def ask(n):
        sampled = n % 2
        return client.completions.create(model="tiny", prompt=PROMPTS[n], max_tokens=NEW, temperature=sampled,
                                         seed=100 + n).choices[0].text
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(16)))
    expected = [alone(tiny, p, temperature=n % 2, seed=100 + n) for n, p in enumerate(PROMPTS)]
    assert answers == expected


def greedy(model, length, **controls):
    """A request of `length` tokens for the scheduler (greedy, seed 0, unless `controls` say
    otherwise), ended at <|endoftext|> as the server's are."""
    from tfgpt2.decoding.request import check_request
    hp = model.hparams
    return check_request(n_vocab=hp.n_vocab, n_ctx=hp.n_ctx, length=length, stop_at_eot=True,
                         **dict(dict(temperature=0.0, seed=0), **controls))


@pytest.mark.slow
def test_a_step_runs_the_slots_up_to_the_highest_in_use(tiny):
    """The scheduler alone (no server): one sequence decodes one slot wide, whatever
    --max_batch; three at once (their prompts read by one prefill call, of four rows: the
    fourth writes nowhere) run four slots wide, and as the first two end the third moves
    down to slot 0 (its cache, penalties' counts and bias with it), so two, then one; each
    sequence's tokens are `generate`'s for its prompt alone, at every width. A sequence decoding
    alone makes its first token in a call of its own, then up to LONE_STEPS a call; several at
    once make one each (--decode_steps 1)."""
    from tfgpt2.decoding.slots import INTS
    from tfgpt2.sample import generate
    from tfgpt2.serve.scheduler import LONE_STEPS, Scheduler, Sequence, width
    assert [width(n, 16) for n in (1, 2, 3, 5, 9, 16)] == [1, 2, 4, 8, 16, 16] and width(5, 6) == 6
    scheduler = Scheduler(tiny, max_batch=8, max_queue=8, chunk=16, eot=ENCODER.eot_token)
    penalties = dict(repetition_penalty=3.0, presence_penalty=2.0, frequency_penalty=5.0)
    eot = {ENCODER.eot_token: -100.0}  # banned: each sequence makes its tokens
    prompts = [ENCODER.encode(p) for p in PROMPTS[:3]]
    # the third, penalized and biased, moves: its prompt holds what the model favours (the repetition
    # penalty's seen tokens), and its bias bans what it would make after the move without the bias
    prompts[2] += generate(tiny, prompts[2:], NEW, temperature=0)[0][len(prompts[2]):].tolist()
    free = generate(tiny, prompts[2:], 2 * NEW, temperature=0, logit_bias=eot, **penalties)[0][len(prompts[2]):]
    bias = {**eot, **{int(t): -100.0 for t in free[NEW:]}}
    moves, move = [], scheduler.slots.move
    scheduler.slots.move = lambda source, target: moves.append(source) or move(source, target)
    budgets, decode = [], scheduler.slots.decode  # each call's budgets of the rows that make tokens
    scheduler.slots.decode = lambda ints, *args: budgets.append(
        sorted(b for b in ints[INTS.index("budget")] if b)) or decode(ints, *args)
    prefills, prefill = [], scheduler.slots.prefill  # each call's rows
    scheduler.slots.prefill = lambda tokens, *args: prefills.append(len(tokens)) or prefill(tokens, *args)

    def run(prompts, new):
        ended = [concurrent.futures.Future() for _ in prompts]
        last = len(prompts) - 1  # the last sequence has penalties and a bias
        sequences = [Sequence(p, greedy(tiny, n, logit_bias=bias, **penalties) if i == last else greedy(
            tiny, n, logit_bias=eot), lambda tokens, logprobs, end, cut, f=f: end and f.set_result(end))
                     for i, (p, n, f) in enumerate(zip(prompts, new, ended))]
        scheduler.submit(sequences)
        concurrent.futures.wait(ended, timeout=120)
        for i, (p, n, s) in enumerate(zip(prompts, new, sequences)):
            controls = dict(logit_bias=bias, **penalties) if i == last else dict(logit_bias=eot)
            assert s.generated == generate(tiny, [p], n, temperature=0, **controls)[0][len(p):].tolist(), p
        return {key[1][0][0][1] for key in scheduler.slots.programs if key[0] == "decode"}, sequences  # ints [.., B]

    engine = concurrent.futures.ThreadPoolExecutor(1).submit(scheduler.run)
    try:
        assert run(prompts[:1], [NEW])[0] == {1} and not moves
        # its first token streamed at once, by a call of its own; then LONE_STEPS a call
        assert budgets == [[1]] + [[min(LONE_STEPS, NEW - k)] for k in range(1, NEW, LONE_STEPS)]
        budgets.clear()
        # the three prompts' first chunks read at once (the third's second alone), then 4 wide, not 8;
        # the third makes the most tokens, and ends in slot 0 (2 wide while the second runs on, then 1)
        widths, sequences = run(prompts, [NEW // 3, NEW // 2, 2 * NEW])
        assert len(prompts[2]) - 1 > 16 and prefills == [1, 3, 1] and widths == {1, 2, 4} and moves == [2] and sequences[2].slot == 0
        assert all(b == [1] * len(b) for b in budgets if len(b) > 1) and [LONE_STEPS] in budgets
    finally:
        scheduler.close()
        engine.result(timeout=60)


@pytest.mark.slow  # compiles the warm-up's 7 programs: about 20 s on 2 cores
def test_a_warmed_scheduler_compiles_nothing_on_a_step_and_its_stand_ins_make_generates_tokens(tiny):
    """After `warm_up`, sequences run without a compile on the engine thread: a prompt of 3
    tokens alone (its chunk of 16 read by the warm-up's chunk of 32, padded), then three at once
    (steps one and two slots wide) with a stop string and a stop token sequence that end them
    (run by the warm-up's step two rows wide with room for every stop, a row padded where one
    runs alone) and a scored prompt of 40 tokens (two chunks). Each makes `generate`'s tokens for
    its prompt alone, to its stop; the scored prompt's log-probabilities are the model's."""
    from tfgpt2.decoding.stops import Vocabulary
    from tfgpt2.sample import generate
    from tfgpt2.serve.scheduler import Scheduler, Sequence
    scheduler = Scheduler(tiny, max_batch=2, max_queue=8, chunk=32, eot=ENCODER.eot_token,
                          vocabulary=Vocabulary.of(ENCODER))
    eot = {ENCODER.eot_token: -100.0}  # banned: each sequence makes its tokens
    prompts = [list(range(300, 303)), ENCODER.encode(PROMPTS[0]), list(range(100, 120)), list(range(200, 240))]
    rows = generate(tiny, prompts, NEW, temperature=0, logit_bias=eot)  # each row as if alone
    alone_ = [row[len(p):len(p) + NEW].tolist() for p, row in zip(prompts, rows)]
    controls = [{}, dict(stop=(ENCODER.decode(alone_[1][4:6]),)), dict(stop_token_ids=((alone_[2][3], alone_[2][4]),)),
                {}]
    ended = [alone_[0], alone_[1][:6], alone_[2][:5], alone_[3]]  # to the stop string's end, and the stop tokens
    done = [concurrent.futures.Future() for _ in prompts]
    sequences = [Sequence(p, greedy(tiny, NEW, logit_bias=eot, **c), lambda tokens, logprobs, end, cut, f=f: end
                          and f.set_result(end), score_prompt=i == 3)
                 for i, (p, c, f) in enumerate(zip(prompts, controls, done))]
    assert scheduler.warm_up() > 0
    programs = scheduler.slots.programs
    # decode at 1 and 2 rows (+ stops), prefills of 1 (scored and not) and 2 prompts, admit, move
    assert programs.count("warmup") == len(programs) == 8
    engine = concurrent.futures.ThreadPoolExecutor(1).submit(scheduler.run)
    try:
        scheduler.submit(sequences[:1])
        done[0].result(timeout=300)
        scheduler.submit(sequences[1:])
        concurrent.futures.wait(done, timeout=300)
        assert programs.count("request") == 0 and programs.stand_ins > 0 and programs.pending > 0
    finally:
        scheduler.close()
        engine.result(timeout=60)
        assert programs.idle(timeout=300)  # the compile under way ends, the others are dropped
    assert [s.generated for s in sequences] == ended
    logits = tiny(np.array([prompts[3]]))["logits"].numpy()[0].astype(np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    scored = np.array([entry[0] for entry in sequences[3].prompt_logprobs])
    np.testing.assert_allclose(scored, logp[np.arange(39), prompts[3][1:]], atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """The tiny model's shape with a context of 128 positions: two blocks of the slot cache."""
    from tests.helpers import TINY
    from tfgpt2.formats.checkpoint import load_model
    from tfgpt2.hparams import default_hparams
    from tfgpt2.testing.checkpoints import make_checkpoint
    return load_model(make_checkpoint(str(tmp_path_factory.mktemp("long") / "long"), default_hparams(
        ).override_from_dict(dict(TINY, n_ctx=128)), std=0.3, seed=1))


def test_the_warm_up_decodes_over_each_window_of_the_first_quarter_and_the_whole_context():
    """GPT-2's context: a decode step's own program over 64, 128, 192 and 256 positions (where
    most steps run) and the whole context's; contexts of a block or less: the whole only."""
    from tfgpt2.decoding.slots import windows
    assert windows(1024) == [64, 128, 192, 256, 1024]
    assert windows(128) == [64, 128] and windows(65) == [64, 65]
    assert windows(64) == [64] and windows(40) == [40]


@pytest.mark.slow
def test_the_warm_up_prefills_a_first_chunk_over_its_own_blocks(long_model):
    """A context of two blocks: besides the whole context's, a prefill of the longest chunk over
    the first block, and a decode step over it, are compiled before the first request, and a
    short prompt's chunk runs that prefill."""
    import tensorflow as tf
    from tfgpt2.serve.scheduler import Scheduler
    scheduler = Scheduler(long_model, max_batch=1, max_queue=1, chunk=32, eot=ENCODER.eot_token)
    scheduler.warm_up()
    programs = scheduler.slots.programs
    windows = sorted(dict(key[2])["window"] for key in programs if key[0] == "prefill")
    assert windows == [64, 128, 128] and programs.count("warmup") == len(programs)
    # a decode step over the whole context (and with every stop) and over its first quarter
    assert sorted(dict(key[2])["window"] for key in programs if key[0] == "decode") == [64, 128, 128]
    key, _ = scheduler.slots.program("prefill", tf.TensorSpec([1, 16], tf.int32), tf.TensorSpec([2, 1], tf.int32),
                                     window=64)
    assert dict(key[2])["window"] == 64 and key[1][0][0] == (1, 32)
    scheduler.close()


def run_alone(scheduler, sequences, ended):
    """The scheduler's engine thread while `sequences` run, each submitted once the one before
    has ended (`ended`: a future per sequence, that its sink sets)."""
    engine = concurrent.futures.ThreadPoolExecutor(1).submit(scheduler.run)
    try:
        for sequence, end in zip(sequences, ended):
            scheduler.submit([sequence])
            end.result(timeout=300)
    finally:
        scheduler.close()
        engine.result(timeout=60)


@pytest.mark.slow  # compiles for a context of 128 positions: 10 to 12 s on 2 cores
def test_sequences_run_across_the_cache_blocks(long_model):
    """A context of 128 positions (two blocks of the slot cache of 64): two sequences decode at
    once at positions of their own, one across the first block's end (from 39 to 78), the other
    in the second block, its prompt read in one chunk across the first block's end; each one's
    tokens are `generate`'s for its prompt alone."""
    from tfgpt2.sample import generate
    from tfgpt2.serve.scheduler import Scheduler, Sequence
    model = long_model
    scheduler = Scheduler(model, max_batch=2, max_queue=2, chunk=128, eot=ENCODER.eot_token)
    eot = {ENCODER.eot_token: -100.0}  # banned: each sequence makes its tokens
    rng = np.random.default_rng(0)
    prompts, new = [rng.integers(0, ENCODER.eot_token, n).tolist() for n in (80, 40)], [40, 40]
    ended = [concurrent.futures.Future() for _ in prompts]
    sequences = [Sequence(p, greedy(model, n, logit_bias=eot), lambda tokens, logprobs, end, cut, f=f: end
                          and f.set_result(end)) for p, n, f in zip(prompts, new, ended)]
    engine = concurrent.futures.ThreadPoolExecutor(1).submit(scheduler.run)
    try:
        scheduler.submit(sequences)
        concurrent.futures.wait(ended, timeout=300)
    finally:
        scheduler.close()
        engine.result(timeout=60)
    expected = generate(model, prompts, max(new), temperature=0, logit_bias=eot)  # each row as if alone
    for p, n, s, row in zip(prompts, new, sequences, expected):
        assert s.generated == row[len(p):len(p) + n].tolist(), len(p)
    assert {dict(key[2])["window"] for key in scheduler.slots.programs if key[0] == "decode"} == {128}  # windows


@pytest.mark.slow  # compiles for a context of 128 positions: 10 to 12 s on 2 cores
def test_a_prompt_read_from_the_prefix_cache_continues_as_without_it(long_model):
    """Three prompts that start with the same 64 tokens (one block), then differ, run one after
    another, greedy and seeded, each after a prompt that starts otherwise (in the same slot),
    with the prefix cache and without: the later two copy the first block from the cache and
    read their prompts on from position 64; their tokens and log-probabilities are the same to
    the bit as without the cache, and the cache counts the tokens asked for and found. A
    prompt's blocks go into the pool once its first token is out (the copies would delay it)."""
    from tfgpt2.serve.scheduler import Scheduler, Sequence
    rng = np.random.default_rng(1)
    shared = rng.integers(0, ENCODER.eot_token, 64).tolist()
    prompts = [shared + rng.integers(0, ENCODER.eot_token, n).tolist() for n in (16, 10, 16)]
    prompts[2][64:] = prompts[0][64:]  # the first prompt again
    others = [rng.integers(0, ENCODER.eot_token, 70).tolist() for _ in range(2)]  # another first block
    prompts = [prompts[0], others[0], prompts[1], others[1], prompts[2]]
    runs = []
    for blocks in (4, 0):
        scheduler = Scheduler(long_model, max_batch=1, max_queue=1, chunk=64, eot=ENCODER.eot_token,
                              prefix_blocks=blocks)
        starts, prefill, save, events = [], scheduler.slots.prefill, scheduler.slots.save, []
        scheduler.slots.prefill = lambda tokens, slots, start, *rest: starts.extend(start) or prefill(
            tokens, slots, start, *rest)
        scheduler.slots.save = lambda slot, places: events.append("save") or save(slot, places)
        ended = [concurrent.futures.Future() for _ in prompts]
        heard = [[] for _ in prompts]
        sequences = [Sequence(p, greedy(long_model, 24, temperature=float(n in (1, 2, 4)), top_p=0.9,
                                        repetition_penalty=1.2, seed=n, logprobs=5),
                              lambda tokens, logprobs, end, cut, n=n: (heard[n].extend(logprobs), events.append(n),
                                                                       end and ended[n].set_result(end))[-1])
                     for n, p in enumerate(prompts)]
        run_alone(scheduler, sequences, ended)
        if blocks:  # a prompt's blocks are kept once its first token is out, not before
            assert events.index("save") == events.index(0) + 1
        runs.append(([s.generated for s in sequences], heard, starts, scheduler.prefix))
    (cached, cached_logprobs, cached_starts, prefix), (alone, alone_logprobs, alone_starts, _) = runs
    assert cached == alone and all(len(tokens) == 24 for tokens in alone) and len(set(map(tuple, alone))) == 5
    for ours, theirs in zip(cached_logprobs, alone_logprobs):
        for (p, ids, top), (q, ids_alone, top_alone) in zip(ours, theirs):
            assert p == q and np.array_equal(ids, ids_alone) and np.array_equal(top, top_alone)
    assert alone_starts == [0, 64] * 5 and cached_starts == [0, 64, 0, 64, 64, 0, 64, 64]
    assert (prefix.queries, prefix.hits) == (sum(map(len, prompts)), 2 * 64)


@pytest.mark.slow
def test_a_seeded_request_repeats_whatever_runs_beside_it(client):
    """The same seeded request alone and beside others with other controls (top-k, top-p,
    min-p, penalties, a bias, other seeds) gives the same text; another seed another text."""
    request = dict(model="tiny", prompt=PROMPTS[0], max_tokens=NEW, temperature=1.0, top_p=0.9, seed=7,
                   extra_body=dict(top_k=50))
    first = client.completions.create(**request).choices[0].text
    others = [dict(temperature=0.7, seed=1, extra_body=dict(top_k=5)),
              dict(temperature=1.3, presence_penalty=0.5, extra_body=dict(min_p=0.05)),
              dict(temperature=1.0, frequency_penalty=0.4, logit_bias={"11": 100},
                   extra_body=dict(repetition_penalty=1.3))]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        beside = [pool.submit(client.completions.create, model="tiny", prompt=PROMPTS[n + 1], max_tokens=NEW, **o)
                  for n, o in enumerate(others)]
        again = pool.submit(client.completions.create, **request).result().choices[0].text
        assert all(f.result().choices[0].text for f in beside)
    assert again == first
    assert client.completions.create(**dict(request, seed=8)).choices[0].text != first
    assert ENCODER.decode([11]) in "".join(f.result().choices[0].text for f in beside[2:])


@pytest.mark.slow
def test_stop_strings_end_the_text_streamed_or_not(client, tiny):
    """A stop string taken from the middle of the greedy text (across tokens): the text ends
    before it, finish_reason "stop", and the streamed chunks join to the same."""
    whole = alone(tiny, PROMPTS[0], temperature=0)
    stop = whole[len(whole) // 3:len(whole) // 3 + 4]
    plain = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=NEW, temperature=0,
                                      stop=["\u2603\u2603", stop])
    texts, reasons, _ = streamed(client, prompt=PROMPTS[0], max_tokens=NEW, temperature=0, stop=stop)
    assert plain.choices[0].text == texts[0] == whole[:whole.find(stop)]
    assert plain.choices[0].finish_reason == reasons[0] == "stop"


@pytest.mark.slow
def test_logprobs_are_the_models(client, tiny):
    """logprobs=3: each sampled token's log-probability and the 3 most likely, against a log
    softmax in NumPy of the model's logits over the prompt and the tokens (`generate`'s, with
    the same seed); streamed, the same entries."""
    from tfgpt2.sample import generate
    prompt = ENCODER.encode(PROMPTS[0])
    ids = generate(tiny, [prompt], NEW, temperature=1.0, seed=3, stop_at_eot=True)[0].tolist()
    out = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=NEW, temperature=1.0, seed=3,
                                    logprobs=3)
    lp = out.choices[0].logprobs
    new = [t for t in ids[len(prompt):] if t != ENCODER.eot_token]
    word = ENCODER.encoding.decode_single_token_bytes
    assert lp.tokens == [token_text(word(t)) for t in new] and lp.text_offset[0] == 0
    logits = tiny(np.array([ids[:-1]]))["logits"].numpy()[0].astype(np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    for j, token in enumerate(new):
        row = logp[len(prompt) - 1 + j]
        best = np.argsort(-row)[:3]
        assert list(lp.top_logprobs[j]) == [token_text(word(b)) for b in best]
        np.testing.assert_allclose([lp.token_logprobs[j], *lp.top_logprobs[j].values()], [row[token], *row[best]],
                                   atol=1e-4)
    _, _, chunks = streamed(client, prompt=PROMPTS[0], max_tokens=NEW, temperature=1.0, seed=3, logprobs=3)
    assert sum((c.choices[0].logprobs.tokens for c in chunks if c.choices), []) == lp.tokens
    echoed = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=NEW, temperature=1.0, seed=3,
                                       logprobs=3, echo=True).choices[0]
    assert echoed.text == PROMPTS[0] + out.choices[0].text
    assert echoed.logprobs.tokens == [token_text(word(t)) for t in prompt] + lp.tokens
    assert echoed.logprobs.text_offset == [len(ENCODER.decode(prompt[:j])) for j in range(len(prompt))] + [
        len(PROMPTS[0]) + offset for offset in lp.text_offset]
    assert echoed.logprobs.token_logprobs[0] is None and echoed.logprobs.top_logprobs[0] is None
    np.testing.assert_allclose(echoed.logprobs.token_logprobs[1:], [logp[j, t] for j, t in enumerate(ids[1:])],
                               atol=1e-4)


def first_new(tokens, start):
    """The first index from `start` whose token is none of those before it."""
    return next(k for k in range(start, len(tokens)) if tokens[k] not in tokens[:k])


@pytest.mark.slow
def test_vllms_stopping_fields_do_what_vllms_do(client, tiny):
    """vLLM's ignore_eos, min_tokens, stop_token_ids and include_stop_str_in_output with the
    `openai` client (extra_body), and stop lists of 6 (a code task's until list and one more) and
    64 strings, each against the greedy text or `generate` with the same controls; <|endoftext|>
    made the model's every choice by a bias."""
    eot, ask = ENCODER.eot_token, dict(model="tiny", prompt=PROMPTS[0], max_tokens=NEW, temperature=0)
    forced = dict(ask, logit_bias={str(eot): 100})
    ended = client.completions.create(**forced)
    assert (ended.choices[0].text, ended.choices[0].finish_reason, ended.usage.completion_tokens) == ("", "stop", 1)
    # ignore_eos: on to max_tokens past <|endoftext|>, which the text leaves out (skip_special_tokens)
    ran = client.completions.create(**forced, logprobs=0, extra_body=dict(ignore_eos=True))
    assert (ran.choices[0].text, ran.choices[0].finish_reason, ran.usage.completion_tokens) == ("", "length", NEW)
    assert ran.choices[0].logprobs.tokens == ["<|endoftext|>"] * NEW
    shown = client.completions.create(**forced, extra_body=dict(ignore_eos=True, skip_special_tokens=False))
    assert shown.choices[0].text == "<|endoftext|>" * NEW
    # min_tokens: <|endoftext|> held back for 5 tokens (the greedy ones without it), then it ends the text
    greedy_ids = token_ids(client.completions.create(**ask, logprobs=0, logit_bias=EOT_BANNED).choices[0].logprobs)
    held = client.completions.create(**forced, logprobs=0, extra_body=dict(min_tokens=5))
    assert (held.choices[0].finish_reason, held.usage.completion_tokens) == ("stop", 6)
    assert token_ids(held.choices[0].logprobs) == greedy_ids[:5]
    assert held.choices[0].text == ENCODER.decode(greedy_ids[:5])
    # stop_token_ids: the text ends before the first one (after it with include_stop_str_in_output)
    k = first_new(greedy_ids, 2)
    for extra, kept in [({}, k), (dict(include_stop_str_in_output=True), k + 1)]:
        out = client.completions.create(**ask, logit_bias=EOT_BANNED, extra_body=dict(stop_token_ids=[greedy_ids[k]],
                                                                                      **extra))
        assert (out.choices[0].text, out.choices[0].finish_reason) == (ENCODER.decode(greedy_ids[:kept]), "stop")
    # min_tokens holds a stop token back too
    late = client.completions.create(**ask, logit_bias=EOT_BANNED, extra_body=dict(stop_token_ids=[greedy_ids[k]],
                                                                                   min_tokens=k + 1))
    assert late.choices[0].text == alone(tiny, PROMPTS[0], temperature=0, logit_bias={eot: -100},
                                         stop_token_ids=[greedy_ids[k]], min_tokens=k + 1)
    assert late.usage.completion_tokens > k + 1
    # stop strings: include_stop_str_in_output keeps the one that ended the text; 6 and 64 of them
    whole = ENCODER.decode(greedy_ids)
    stop = whole[len(whole) // 3:len(whole) // 3 + 4]
    until_list = ["\nclass", "\ndef", "\n#", "\nif", "\nprint"]
    end = min(whole.find(s) % (len(whole) + 1) for s in until_list + [stop])
    for stops, extra, text in [([stop], dict(include_stop_str_in_output=True), whole[:whole.find(stop) + len(stop)]),
                               (until_list + [stop], {}, whole[:end]),
                               ([f"\u2603{n}" for n in range(63)] + [stop], {}, whole[:whole.find(stop)])]:
        out = client.completions.create(**ask, logit_bias=EOT_BANNED, stop=stops, extra_body=extra)
        assert (out.choices[0].text, out.choices[0].finish_reason) == (text, "stop"), len(stops)


@pytest.mark.slow
def test_guidellms_streamed_request_with_continuous_usage(server):
    """guidellm's request as it sends it (plain HTTP): streamed, ignore_eos, stop null,
    stream_options with include_usage and vLLM's continuous_usage_stats: a chunk per step with
    tokens, each carrying the usage so far, counting up to max_tokens; then the usage chunk."""
    body = dict(model="tiny", prompt=PROMPTS[1], max_tokens=NEW, stream=True, stop=None, ignore_eos=True,
                logit_bias={str(ENCODER.eot_token): 5}, stream_options={"include_usage": True,
                                                                       "continuous_usage_stats": True})
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=120) as answer:
        assert answer.status_code == 200
        lines = [line[6:] for line in answer.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    prompt_tokens = len(ENCODER.encode(PROMPTS[1]))
    counts = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
    assert all(c["usage"]["prompt_tokens"] == prompt_tokens and c["usage"]["total_tokens"] == prompt_tokens + n
               for c, n in zip(chunks, counts))
    assert counts == sorted(counts) and counts[-1] == NEW and len(set(counts)) == len(counts)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == NEW
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


@pytest.mark.slow
def test_max_tokens_0_with_echo_scores_the_prompt(server, client, tiny):
    """max_tokens 0 with echo and logprobs: the prompt alone, nothing generated, each token's
    log-probability (the first null) and the most likely ones equal to a log softmax in NumPy of
    the model's logits; streamed, the same text; vLLM's prompt_logprobs (plain HTTP) the same
    values with each token's rank."""
    prompt = ENCODER.encode(PROMPTS[0])
    logits = tiny(np.array([prompt]))["logits"].numpy()[0].astype(np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    word = ENCODER.encoding.decode_single_token_bytes
    out = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=0, echo=True, logprobs=2)
    c = out.choices[0]
    assert (c.text, c.finish_reason, out.usage.completion_tokens) == (PROMPTS[0], "length", 0)
    assert c.logprobs.tokens == [token_text(word(t)) for t in prompt]
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    np.testing.assert_allclose(c.logprobs.token_logprobs[1:], [logp[j, t] for j, t in enumerate(prompt[1:])],
                               atol=1e-4)
    for j, best in enumerate(c.logprobs.top_logprobs[1:]):
        ids = np.argsort(-logp[j])[:2]
        assert list(best) == [token_text(word(t)) for t in ids]
        np.testing.assert_allclose(list(best.values()), logp[j, ids], atol=1e-4)
    texts, reasons, _ = streamed(client, prompt=PROMPTS[0], max_tokens=0, echo=True)
    assert (texts[0], reasons[0]) == (PROMPTS[0], "length")
    cut = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=0, echo=True, logprobs=0,
                                    extra_body=dict(truncate_prompt_tokens=3, return_tokens_as_token_ids=True))
    assert cut.choices[0].text == ENCODER.decode(prompt[-3:]) and cut.usage.prompt_tokens == 3
    assert cut.choices[0].logprobs.tokens == [f"token_id:{t}" for t in prompt[-3:]]
    answer = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=120, json=dict(
        model="tiny", prompt=prompt, max_tokens=1, temperature=0, prompt_logprobs=1)).json()
    rows = answer["choices"][0]["prompt_logprobs"]
    assert rows[0] is None and len(rows) == len(prompt)
    for j, (token, row) in enumerate(zip(prompt[1:], rows[1:])):
        rank = 1 + int((logp[j] > logp[j, token]).sum())
        best = int(np.argmax(logp[j]))
        assert row[str(token)]["rank"] == rank and row[str(token)]["decoded_token"] == token_text(word(token))
        assert row[str(best)]["rank"] == 1 and set(row) == {str(token), str(best)}
        np.testing.assert_allclose([row[str(token)]["logprob"], row[str(best)]["logprob"]],
                                   [logp[j, token], logp[j, best]], atol=1e-4)


OPENAI_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "presence_penalty",
                 "frequency_penalty", "logit_bias", "logprobs", "echo", "stream", "stream_options", "best_of",
                 "suffix"}
BAD = [  # (request fields, status, the message's words, the field it names)
    (dict(model="nope"), 404, "`nope` does not exist", "model"),
    (dict(max_token=5), 400, r"unknown field 'max_token' \(did you mean max_tokens\?\)", "max_token"),
    (dict(use_beam_search=True), 400, r"use_beam_search \(beam search\) is not supported", "use_beam_search"),
    (dict(guided_json={"type": "object"}), 400, "guided_json .* is not supported", "guided_json"),
    (dict(min_tokens=5), 400, r"min_tokens must be at most max_tokens \(4\), got 5", "min_tokens"),
    (dict(stop_token_ids=[50257]), 400, r"stop_token_ids sequence 0 token must be a token id in \[0, n_vocab=50257\)",
     "stop_token_ids"),
    (dict(prompt_logprobs=1, stream=True), 400, "prompt_logprobs are not streamed", "prompt_logprobs"),
    (dict(prompt_logprobs=6), 400, r"prompt_logprobs must be an integer in \[0, 6\)", "prompt_logprobs"),
    (dict(ignore_eos=True, stop=["x"]), 400, "stop strings with ignore_eos need skip_special_tokens false", "stop"),
    (dict(ignore_eos="yes"), 400, "ignore_eos must be true or false", "ignore_eos"),
    (dict(stream=True, stream_options={"continuous_usage_stats": 1}), 400,
     "stream_options.continuous_usage_stats must be true or false", "stream_options"),
    (dict(truncate_prompt_tokens=0), 400, r"truncate_prompt_tokens must be an integer in \[1, 65\), got 0",
     "truncate_prompt_tokens"),
    (dict(max_tokens=0, logprobs=1), 400, r"max_tokens must be .* \(0 only with echo", "max_tokens"),
    (dict(prompt=[50257]), 400, r"prompt 0: token ids must be in \[0, n_vocab=50257\), got \[50257\]", "prompt"),
    (dict(prompt=[[1, 2], [-1]]), 400, r"prompt 1: token ids must be in \[0, n_vocab=50257\), got \[-1\]", "prompt"),
    (dict(prompt=[1] * 60, max_tokens=10), 400, "prompt of 60 tokens \\+ max_tokens 10 - 1 exceeds the context window "
                                                "n_ctx=64", "prompt"),
    (dict(prompt=""), 400, "every prompt needs at least one token", "prompt"),
    (dict(prompt=[1.5]), 400, "must be a string or a list of token ids", "prompt"),
    (dict(prompt=["a"] * 17), 400, "prompts x n = 17 completions; one request may ask for at most 16", "prompt"),
    (dict(max_tokens=0), 400, r"max_tokens must be an integer in \[1, 2\*\*31\), got 0", "max_tokens"),
    (dict(max_tokens="ten"), 400, r"max_tokens must be an integer in \[1, 2\*\*31\), got 'ten'", "max_tokens"),
    (dict(max_tokens=int("9" * 4000)), 400, r"got 99999999999999999999\.\.\.99999999999999999999$", "max_tokens"),
    (dict(temperature=-1), 400, "temperature must be a finite number >= 0", "temperature"),
    (dict(top_p=1.5), 400, r"top_p must be a number in \[0, 1\]", "top_p"),
    (dict(top_k=-1), 400, r"top_k must be an integer in \[0, 2\*\*31\), got -1", "top_k"),
    (dict(min_p=2), 400, r"min_p must be a number in \[0, 1\]", "min_p"),
    (dict(presence_penalty=-1), 400, "presence_penalty must be a finite number >= 0", "presence_penalty"),
    (dict(repetition_penalty=0), 400, "repetition_penalty must be a finite number > 0", "repetition_penalty"),
    (dict(logit_bias={"x": 1}), 400, "logit_bias keys must be token ids in decimal digits, got 'x'", "logit_bias"),
    (dict(logit_bias={"1_000": 1}), 400, "got '1_000'", "logit_bias"),
    (dict(logit_bias={" 7 ": 1}), 400, "got ' 7 '", "logit_bias"),
    (dict(logit_bias={"+7": 1}), 400, "got '\\+7'", "logit_bias"),
    (dict(logit_bias={"\u0663": 1}), 400, "got '\u0663'", "logit_bias"),  # an Arabic-Indic 3, which int() reads
    (dict(logit_bias={"7" * 5000: 1}), 400, r"got '7{10,20}\.\.\.7{10,20}'$", "logit_bias"),
    (dict(logit_bias={"50257": 1}), 400, r"logit_bias token must be a token id in \[0, n_vocab=50257\), got 50257",
     "logit_bias"),
    (dict(logprobs=6), 400, r"logprobs must be an integer in \[0, 6\), got 6", "logprobs"),
    (dict(stop=["s"] * 65), 400, "stop: at most 64 stop strings, got 65", "stop"),
    (dict(stop=[""]), 400, "stop 0 must be 1 to 64 bytes of UTF-8, got 0", "stop"),
    (dict(stop=5), 400, "stop must be a string or a list of strings, got 5", "stop"),
    (dict(n=0), 400, r"n must be an integer in \[1, 2\*\*31\), got 0", "n"),
    (dict(n=17), 400, "at most 16", "n"),
    (dict(seed=-1), 400, r"seed must be an integer in \[0, 2\*\*63\), got -1", "seed"),
    (dict(echo="yes"), 400, "echo must be true or false", "echo"),
    (dict(stream_options={"include_usage": True}), 400, "only allowed with stream", "stream_options"),
    (dict(context_keep=64), 400, r"context_keep must be an integer in \[1, 64\), got 64", "context_keep"),
    (dict(best_of=3), 400, "not supported", "best_of"),
    (dict(suffix="x"), 400, "not supported", "suffix"),
]


@pytest.mark.slow
def test_bad_requests_get_their_status_and_the_server_serves_on(server, client):
    """Each bad request is answered with OpenAI's error object, its status, the generation
    rule's message and the field at fault as `param`; a long value is quoted by a short prefix
    and suffix, not whole. NaN, a body that is no JSON and a JSON value that is no object are
    sent raw; the server still answers after."""
    for fields, status, words, param in BAD:
        known = {k: v for k, v in fields.items() if k in OPENAI_FIELDS}
        request = dict(dict(model="tiny", prompt="Hi", max_tokens=4), **known)
        with pytest.raises(openai.APIStatusError) as caught:
            client.completions.create(**request, extra_body={k: v for k, v in fields.items() if k not in known})
        error = caught.value
        assert (error.status_code, error.param) == (status, param) and re.search(words, error.message), (fields, error)
        assert len(error.message) < 400
    for body, words in [('{"model": "tiny", "prompt": "Hi", "temperature": NaN}', "temperature must be a finite "
                         "number >= 0, got nan"), ('{"model": "tiny", "prompt": ', "not valid JSON"),
                        ('[1, 2]', "must be a JSON object")]:
        answer = httpx.post(server.url + "/v1/completions", content=body, headers=AUTH)
        assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request_error"
        assert re.search(words, answer.json()["error"]["message"])
    assert client.completions.create(model="tiny", prompt="Hi", max_tokens=4, temperature=0).choices[0].text


@pytest.mark.slow
def test_every_route_answers_in_openais_shape(server):
    """A route or method that does not exist, and FastAPI's own /docs, /redoc and
    /openapi.json (off), get 404 or 405 with OpenAI's error object."""
    for method, path, status in [("GET", "/v1/nope", 404), ("POST", "/v1/chat/completions", 404),
                                 ("GET", "/docs", 404), ("GET", "/redoc", 404), ("GET", "/openapi.json", 404),
                                 ("GET", "/v1/completions", 405), ("DELETE", "/v1/models", 405)]:
        answer = httpx.request(method, server.url + path, headers=AUTH)
        error = answer.json()["error"]
        assert answer.status_code == status and path in error["message"], (method, path, answer.text)
        assert set(error) == {"message", "type", "param", "code"}


@pytest.mark.slow
def test_an_api_key_guards_every_route_but_health(server):
    """Without the key, with another, or not as a Bearer token: 401 and OpenAI's error object
    (the `openai` client raises AuthenticationError) on every route but /health; with it, 200.
    The key was given in the environment: the server's command line does not show it."""
    for key in ("wrong", KEY[:-1], KEY + "x"):
        with pytest.raises(openai.AuthenticationError) as caught:
            openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0).models.list()
        assert caught.value.code == "invalid_api_key"
    for path in ("/v1/models", "/v1/models/tiny", "/metrics", "/version", "/tokenizer_info", "/nope"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                        {"Authorization": f"Basic {KEY}"}):
            answer = httpx.get(server.url + path, headers=headers)
            assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key", (path, headers)
        assert httpx.get(server.url + path, headers=AUTH).status_code == (404 if path == "/nope" else 200)
    for path in ("/v1/completions", "/tokenize"):
        assert httpx.post(server.url + path, json={"model": "tiny", "prompt": "Hi"}).status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200
    assert KEY not in open(f"/proc/{server.child.pid}/cmdline").read()


def test_public_metrics_and_docs_are_asked_for(tiny):
    """The app alone (no server process): with `public_metrics` /metrics answers without the
    key, the other routes still need it; with `docs` FastAPI's pages are served."""
    from starlette.testclient import TestClient
    from tfgpt2.serve.app import create_app
    from tfgpt2.serve.scheduler import Scheduler
    scheduler = Scheduler(tiny, max_batch=1, max_queue=0, eot=ENCODER.eot_token)
    app = create_app(scheduler, model_name="tiny", encoder=ENCODER, hparams=tiny.hparams, api_key=KEY,
                     public_metrics=True, docs=True)
    http = TestClient(app)  # no lifespan: the engine thread does not start
    assert http.get("/metrics").status_code == 200 and http.get("/v1/models").status_code == 401
    assert http.get("/openapi.json", headers=AUTH).json()["info"]["title"] == "tfgpt2"
    assert http.get("/docs", headers=AUTH).status_code == 200


@pytest.mark.slow
def test_tokenize_and_detokenize_round_trip(server):
    """vLLM's /tokenize gives the tokenizer's ids for the prompt (<|endoftext|> the special
    token), their count and strings (Hugging Face's byte-level ones); /detokenize gives the
    text back; /tokenizer_info and /version as vLLM shapes them; bad requests get 400s."""
    def post(path, **body):
        return httpx.post(server.url + path, json=body, headers=AUTH)
    for prompt in PROMPTS:
        ids = ENCODER.encode(prompt, allowed_special="all")
        answer = post("/tokenize", model="tiny", prompt=prompt, return_token_strs=True).json()
        assert answer == {"count": len(ids), "max_model_len": 64, "tokens": ids,
                          "token_strs": [ENCODER.decoder[t] for t in ids]}
        assert post("/tokenize", prompt=prompt, add_special_tokens=True).json()["token_strs"] is None
        assert post("/detokenize", model="tiny", tokens=ids).json() == {"prompt": prompt}
    info = httpx.get(server.url + "/tokenizer_info", headers=AUTH).json()
    assert info["tokenizer_class"] == "GPT2Tokenizer" and info["eos_token"] == "<|endoftext|>"
    assert info["model_max_length"] == 64
    assert httpx.get(server.url + "/version", headers=AUTH).json()["version"]
    for path, body, param in [("/tokenize", dict(prompt=[1, 2]), "prompt"), ("/tokenize", dict(text="Hi"), "text"),
                              ("/detokenize", dict(tokens=[50257]), "tokens"), ("/detokenize", dict(tokens=[True]),
                                                                                "tokens")]:
        answer = post(path, **body)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param, (path, body)
    assert post("/tokenize", model="gpt-4", prompt="Hi").status_code == 404


def metric(url, name):
    """A figure of the server's /metrics."""
    text = httpx.get(url + "/metrics", headers=AUTH).text
    return float(re.search("^" + re.escape(name) + r" (\S+)$", text, re.M).group(1))


def token_ids(logprobs):
    """The token ids of a choice's logprobs.tokens (texts, or "bytes:\\xNN..." where no text)."""
    return [ENCODER.encoding.encode_single_token(
        bytes.fromhex(t[6:].replace("\\x", "")) if t.startswith("bytes:") else t.encode()) for t in logprobs.tokens]


@pytest.mark.slow
def test_past_n_ctx_with_context_keep_slides(client):
    """A request past n_ctx with context_keep (greedy) is the window's completion (n_ctx + 1 -
    prompt tokens), then the completion of its last context_keep tokens, as `generate` slides."""
    prompt, keep = ENCODER.encode(PROMPTS[0]), 32
    ask = dict(model="tiny", temperature=0, logprobs=0, logit_bias=EOT_BANNED)
    first = token_ids(client.completions.create(prompt=prompt, max_tokens=65 - len(prompt), **ask).choices[0].logprobs)
    rest = token_ids(client.completions.create(prompt=(prompt + first)[-keep:], max_tokens=80 - len(first),
                                               **ask).choices[0].logprobs)
    slid = client.completions.create(prompt=prompt, max_tokens=80, extra_body=dict(context_keep=keep), **ask)
    assert token_ids(slid.choices[0].logprobs) == first + rest and slid.usage.completion_tokens == 80


# Requests of each kind: prompts of 1 to 40 tokens (one to three chunks), n, sampling, stop
# strings, stop token sequences, min_tokens, penalties and a bias, log-probabilities, echo,
# prompt_logprobs, and one past n_ctx that slides
VARIED = [dict(prompt=[1], max_tokens=3),
          dict(prompt=PROMPTS[0], max_tokens=12, n=2, temperature=0.8, seed=1, stop=["\n", "the"], logprobs=2),
          dict(prompt=list(range(100, 140)), max_tokens=8, echo=True, logprobs=1),
          dict(prompt=list(range(200, 217)), max_tokens=20, stop=["a stop string of thirty bytes", "x", "y", "z", "w"],
               frequency_penalty=0.5, presence_penalty=0.5, logit_bias={"11": 5},
               extra_body=dict(repetition_penalty=1.3, stop_token_ids=[[1, 2], [3]], min_tokens=2,
                               include_stop_str_in_output=True)),
          dict(prompt=list(range(300, 320)), max_tokens=4, extra_body=dict(prompt_logprobs=2, ignore_eos=True)),
          dict(prompt=[1], max_tokens=70, logit_bias=EOT_BANNED, extra_body=dict(context_keep=32))]
ON_A_STEP = 'tfgpt2_compiled_programs{path="request"}'


@pytest.mark.slow
def test_a_server_compiles_nothing_on_a_requests_step(server, client):
    """The server compiled its stand-ins before /health answered (with the warm-up's seconds):
    requests of every kind, one at a time (steps one slot wide) and all at once (two and four
    wide, sequences moving down as others end), compile nothing on a request's step
    (`tfgpt2_compiled_programs{path="request"}` stays 0: stand-ins run them while their own
    programs compile in the background, whatever ran before)."""
    assert metric(server.url, 'tfgpt2_compiled_programs{path="warmup"}') > 0
    assert metric(server.url, "tfgpt2_warmup_seconds") > 0 and metric(server.url, ON_A_STEP) == 0
    for request in VARIED:
        client.completions.create(model="tiny", **request)
    with concurrent.futures.ThreadPoolExecutor(len(VARIED)) as pool:
        list(pool.map(lambda request: client.completions.create(model="tiny", **request), VARIED + VARIED[:3]))
    assert metric(server.url, ON_A_STEP) == 0 and metric(server.url, "tfgpt2_compiles_refused") == 0
    if sys.platform.startswith("linux"):  # the compiled code's memory maps, against the bound the server keeps under
        assert 0 < metric(server.url, "tfgpt2_memory_maps") < metric(server.url, "tfgpt2_memory_maps_limit")


def log_lines(server, words):
    """The lines of the server's log that hold `words`; AssertionError if the log holds a traceback."""
    text = server.log.read_text()
    assert "Traceback" not in text, text[-3000:]
    return [line for line in text.splitlines() if words in line]


@pytest.mark.slow
def test_a_full_server_answers_429_and_a_client_that_leaves_frees_its_slots(server, client):
    """A streamed request for 16 completions of a million tokens: 4 run, 12 wait, and the next
    request gets 429 with Retry-After while its stream goes on. Its client leaves: its slots
    and queue places free (where they would take hours to end), one line of the log says so,
    no traceback, and the server serves on."""
    url = server.url
    busy = Reader(url, dict(LONG, n=16))
    assert busy.first.wait(120)
    assert until(lambda: metric(url, "tfgpt2_running") == SLOTS and metric(url, "tfgpt2_queue_depth") == 16 - SLOTS)
    refused = httpx.post(url + "/v1/completions", json=dict(model="tiny", prompt="Hi", max_tokens=2), headers=AUTH)
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    seen = len(busy.lines)
    assert until(lambda: len(busy.lines) >= seen + 15)
    busy.close()
    assert until(lambda: metric(url, "tfgpt2_running") == metric(url, "tfgpt2_queue_depth") == 0)
    answer_id = json.loads(busy.lines[0][1][6:])["id"]
    assert until(lambda: log_lines(server, answer_id))
    assert len(log_lines(server, answer_id)) == 1 and "16 of its 16 completions cancelled" in log_lines(
        server, answer_id)[0]
    assert client.completions.create(model="tiny", prompt="Hi", max_tokens=4).usage.completion_tokens >= 1
    metrics = httpx.get(url + "/metrics", headers=AUTH).text
    for name in ('tfgpt2_requests_total{status="200"}', 'tfgpt2_requests_total{status="499"}',
                 'tfgpt2_requests_total{status="429"}', "tfgpt2_time_to_first_token_seconds_count",
                 "tfgpt2_prompt_tokens_total", "tfgpt2_batch_occupancy"):
        assert re.search("^" + re.escape(name) + " [0-9]", metrics, re.M), name


def raw(server, data):
    """Send `data` on a connection of its own; the server's answer, (status, JSON body), once it
    closes the connection."""
    with socket.create_connection(("127.0.0.1", urllib.parse.urlsplit(server.url).port), timeout=120) as s:
        s.sendall(data)
        received = b""
        while chunk := s.recv(65536):
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def post_head(length, chunked=False):
    """The head of a completions request with the key and a body of `length` bytes (or chunked)."""
    size = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % length
    return b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n%s\r\n\r\n" % (KEY.encode(), size)


@pytest.mark.slow
def test_hostile_bodies_are_refused_while_a_stream_runs_on(server):
    """While a completion streams: 100,000 nested arrays get 400 (no RecursionError); a body of
    1.5M short prompts (9 MB) gets 413 from its Content-Length, before a byte of it is read; a
    chunked body gets 413 once more than the limit is in; 150,000 prompts under the limit get 400 before one is
    tokenized; /health answers throughout, and the stream's tokens keep arriving (no gap of
    seconds: a 20 MB body stalled every stream for 5.9 s when bodies were parsed and tokenized
    on the event loop)."""
    stream = Reader(server.url, LONG)
    assert stream.first.wait(120)
    start = time.monotonic()
    nested = '{"model": "tiny", "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"
    answer = httpx.post(server.url + "/v1/completions", content=nested, headers=AUTH)
    assert answer.status_code == 400 and "nests JSON" in answer.json()["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200
    huge = len(json.dumps({"model": "tiny", "prompt": ["ab"] * 1_500_000}))
    status, body = raw(server, post_head(huge))  # its head alone: the server answers before a byte of the body
    assert huge > 9 * LIMIT and status == 413 and body["error"]["code"] == "request_too_large"
    status, _ = raw(server, post_head(0, chunked=True) + b"%x\r\n" % (LIMIT + 1) + b" " * (LIMIT + 1))
    assert status == 413
    many = json.dumps({"model": "tiny", "prompt": ["ab"] * 150_000})
    answer = httpx.post(server.url + "/v1/completions", content=many, headers=AUTH)
    assert len(many) < LIMIT and answer.status_code == 400 and answer.json()["error"]["param"] == "prompt"
    assert httpx.get(server.url + "/health").status_code == 200
    refused = time.monotonic()  # the stream goes on after them (its next chunk within the bound)
    assert until(lambda: any(t > refused for t, _ in stream.lines), timeout=3.0)
    end = time.monotonic()
    stream.close()
    arrived = [t for t, _ in stream.lines if start < t < end]
    assert max(np.diff([start] + arrived + [end])) < 3.0, np.diff([start] + arrived + [end]).max()
    assert until(lambda: metric(server.url, "tfgpt2_running") == 0)


def test_bodies_are_parsed_in_a_worker_thread():
    """`guards.read_json` parses a body (and so checks and tokenizes it) in a worker thread,
    never on the event loop's, and refuses one over its limit unparsed (413), whether its
    Content-Length says so or its bytes do."""
    from tfgpt2.serve.guards import read_json
    from tfgpt2.serve.protocol import RequestError

    class Request:  # what read_json reads of Starlette's
        def __init__(self, body, length):
            self.body, self.headers = body, {"content-length": str(length)} if length is not None else {}

        async def stream(self):
            for n in range(0, len(self.body), 3):
                yield self.body[n:n + 3]

    def parse(value):
        return value, threading.get_ident()

    assert asyncio.run(read_json(Request(b'{"a": [1]}', 10), 10, parse)) == ({"a": [1]}, mock.ANY)
    assert asyncio.run(read_json(Request(b'{"a": [1]}', 10), 10, parse))[1] != threading.get_ident()
    for body, length in [(b"{}", 11), (b'{"a": [1, 2]}', None)]:
        with pytest.raises(RequestError) as caught:
            asyncio.run(read_json(Request(body, length), 10, lambda value: pytest.fail("parsed")))
        assert caught.value.status == 413


@pytest.mark.slow
def test_stalled_connections_are_closed_by_the_timeouts(server, client):
    """20 connections that stall (nothing sent, headers never ended, a body never ended, idle
    after an answer) are closed by the server within --request_timeout while it serves
    others; a stall in the headers is one line of the log, and nothing is a traceback."""
    stalls = [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", post_head(100) + b'{"model": "ti',
              b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"]
    port = urllib.parse.urlsplit(server.url).port
    before = len(log_lines(server, "headers not in whole"))
    sockets = [socket.create_connection(("127.0.0.1", port), timeout=120) for _ in range(20)]
    try:
        for n, s in enumerate(sockets):
            s.sendall(stalls[n % 4])
        assert client.completions.create(model="tiny", prompt="Hi", max_tokens=4).usage.completion_tokens >= 1
        for n, s in enumerate(sockets):
            received = b""
            while chunk := s.recv(65536):  # b"": the server closed it (a timeout raises)
                received += chunk
            assert received.startswith(b"HTTP/1.1 200") == (n % 4 == 3), (n, received)
    finally:
        for s in sockets:
            s.close()
    assert len(log_lines(server, "headers not in whole")) - before == 5


@pytest.mark.slow
def test_sigterm_drains_within_its_bound_then_exits_0(servers):
    """SIGTERM with a stalled socket open and two requests running: /health and new requests
    get 503 at once; a short request finishes whole; one that would run for hours is cut off
    at --drain_timeout with a 503 error object in its stream; the stalled socket is closed,
    and the process exits 0 within the bound. On a server of its own (it ends it; without the
    warm-up, which the module's server has done: its requests compile their programs), so
    that the module's server serves the tests that follow in the shuffled order."""
    server = servers.alone("--no_warmup")
    url, child = server.url, server.child
    client = client_of(server)
    port = urllib.parse.urlsplit(url).port
    endless = Reader(url, LONG)
    assert endless.first.wait(120)
    stalled = socket.create_connection(("127.0.0.1", port), timeout=120)
    stalled.sendall(post_head(100) + b'{"model": ')
    short = Reader(url, dict(model="tiny", prompt=[1], n=3, max_tokens=8, stream=True, logit_bias=EOT_BANNED,
                             stream_options={"include_usage": True}))
    assert short.first.wait(120)
    child.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    assert until(lambda: httpx.get(url + "/health").status_code == 503)
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model="tiny", prompt="Hi", max_tokens=2)
    assert refused.value.status_code == 503
    short.join(timeout=120)
    assert short.lines[-1][1] == "data: [DONE]"
    assert json.loads(short.lines[-2][1][6:])["usage"]["completion_tokens"] == 3 * 8
    endless.join(timeout=120)
    assert json.loads(endless.lines[-1][1][6:])["error"]["code"] == "service_unavailable"
    assert endless.lines[-1][0] - signalled > DRAIN - 0.5
    assert stalled.recv(65536) == b""
    stalled.close()
    assert child.wait(timeout=120) == 0
    assert time.monotonic() - signalled < DRAIN + 60  # the drain, the grace for open connections, TensorFlow's exit
    log_lines(server, "")
