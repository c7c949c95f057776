"""The HTTP server: FastAPI routes over a `Scheduler` (`create_app`), run by uvicorn (`serve`).

`POST /v1/completions` (plain or streamed as server-sent events), `GET /v1/models` and
`/v1/models/{id}`, vLLM's `/tokenize`, `/detokenize`, `/tokenizer_info` and `/version`
(`tokenizer`), `GET /health` (503 while draining, so that a load balancer stops sending) and
`GET /metrics` (Prometheus). With an API key every route but /health (and /metrics, where asked)
needs it (`guards.RequireKey`); a route or method that does not exist gets OpenAI's error object.
The scheduler's engine thread runs every TensorFlow program; a request's body is read here, on
the event loop, up to a bound, then parsed, checked and tokenized (`protocol.parse`) in a worker
thread (`guards.read_json`), and answered here. A client that leaves is one line of the log.
SIGTERM or SIGINT drains (`server.Server`).
"""
import asyncio
import contextlib
import functools
import json
import logging
import threading
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from . import protocol, tokenizer
from ..decoding.programs import memory_maps
from ..decoding.step import LENGTH
from ..decoding.stops import Vocabulary
from ..decoding.text import TextStream, token_text
from .guards import MAX_BODY, RequireKey, no_route, read_json
from .protocol import RequestError
from .scheduler import ERROR, QueueFull, Scheduler, Sequence
from .server import Server, config

RETRY_AFTER = 1  # seconds a client told 429 waits
COMPLETIONS = "/v1/completions"

log = logging.getLogger("uvicorn.error")


class Metrics:
    """The server's Prometheus metrics, in a registry of its own: requests by status, prompt
    tokens, and vLLM's latencies (time to first token, between tokens, in the queue, of whole
    requests) counted here; tokens generated, queue depth, running completions, batch
    occupancy, compiled programs (by where they compiled: the start-up warm-up, the background,
    or a request's step, which waited on it), steps run by a stand-in, the warm-up's seconds and
    the prefix cache's queries and hits read from the scheduler at each scrape."""

    def __init__(self, scheduler):
        self.registry = r = CollectorRegistry()
        self.scheduler = scheduler
        self.requests = Counter("tfgpt2_requests", "Completion requests answered, by HTTP status", ["status"],
                                registry=r)
        self.prompt_tokens = Counter("tfgpt2_prompt_tokens", "Prompt tokens of the completions answered", registry=r)
        seconds = (.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
        self.first_token, self.inter_token, self.queue_time, self.e2e = (
            Histogram("tfgpt2_" + name, text, buckets=seconds, registry=r) for name, text in [
                ("time_to_first_token_seconds", "Seconds from a request to its first token"),
                ("inter_token_latency_seconds", "Seconds between a completion's tokens"),
                ("request_queue_time_seconds", "Seconds a completion waited for a slot"),
                ("e2e_request_latency_seconds", "Seconds from a request to its whole answer")])
        r.register(self)

    def collect(self):
        s = self.scheduler
        yield CounterMetricFamily("tfgpt2_generation_tokens", "Tokens generated (cancelled completions' too)",
                                  value=s.generated)
        for name, text, value in [("queue_depth", "Completions waiting for a slot", s.queued),
                                  ("running", "Completions in a slot", s.occupied),
                                  ("batch_occupancy", "Share of the slots in use", s.occupied / s.max_batch),
                                  ("warmup_seconds", "Seconds the start-up warm-up took (0: none)", s.warmed or 0)]:
            yield GaugeMetricFamily("tfgpt2_" + name, text, value=value)
        programs = s.slots.programs
        compiled = GaugeMetricFamily("tfgpt2_compiled_programs", "Programs compiled (one per shape bucket), by "
                                     "where: the start-up warm-up, the background, a request's step", labels=["path"])
        for path in ("warmup", "background", "request"):
            compiled.add_metric([path], programs.count(path))
        yield compiled
        yield GaugeMetricFamily("tfgpt2_compiles_pending", "Programs queued to compile in the background",
                                value=programs.pending)
        yield CounterMetricFamily("tfgpt2_stand_in_steps", "Steps run by a wider program while theirs compiled",
                                  value=programs.stand_ins)
        yield GaugeMetricFamily("tfgpt2_compiles_refused", "Programs the warm-up or the background did not compile: "
                                "too few memory maps left (vm.max_map_count); wider ones stand in",
                                value=len(programs.refused))
        held = memory_maps()
        if held is not None:
            yield GaugeMetricFamily("tfgpt2_memory_maps", "Memory maps the process holds (XLA's code: three a kernel)",
                                    value=held[0])
            yield GaugeMetricFamily("tfgpt2_memory_maps_limit", "The most it may hold (vm.max_map_count)", value=held[1])
        for name, text in [("queries", "Prompt tokens looked up in the prefix cache"),
                           ("hits", "Prompt tokens found in the prefix cache (read from it, not computed)")]:
            yield CounterMetricFamily("tfgpt2_prefix_cache_" + name, text,
                                      value=getattr(s.prefix, name) if s.prefix else 0)


class Choice:
    """One choice of a request: its sequence, its text stream, and the events of both, which
    the engine thread hands to the event loop."""

    def __init__(self, index, prompt, completion, encoder, events, loop):
        self.index, self.encoder, self.events, self.loop = index, encoder, events, loop
        echo = completion.echo and (completion.texts[prompt] if completion.texts[prompt] is not None
                                    else encoder.decode(completion.prompts[prompt]))
        self.echo, self.token_ids = echo or "", completion.token_ids
        self.echo_entries = completion.echo and completion.logprobs is not None  # the prompt's, in `logprobs`
        request = completion.request_of(index)
        token_bytes = encoder.encoding.decode_single_token_bytes
        if completion.skip_special:  # the <|endoftext|> tokens that ignore_eos runs past, left out of the text
            token_bytes = functools.partial(_skipped, token_bytes, request.eot)
        self.stream = TextStream(token_bytes, request.stop, offset=len(self.echo))
        self.sequence = Sequence(completion.prompts[prompt], request, self.sink, score_prompt=completion.scored,
                                 generate=completion.generate)
        self.tokens, self.started = 0, False

    def sink(self, tokens, logprobs, finish, cut):
        """The scheduler's call (engine thread): the new tokens as text, the text's end where
        the step ended the choice (`decoding.step`: its <|endoftext|> or stop left out); the
        first event's text starts with the echoed prompt."""
        first, self.started, self.tokens = not self.started, True, self.tokens + len(tokens)
        entries = logprobs and [self.entry(token, values) for token, values in zip(tokens, logprobs)]
        if finish == ERROR:
            text, released, reason = "", [], "error"
        elif finish:
            (text, released), reason = self.stream.finish(tokens, entries, finish, cut), (
                "length" if finish == LENGTH else "stop")
        else:
            (text, released), reason = self.stream.feed(tokens, entries), None
        if first:
            text = self.echo + text
            if self.echo_entries:  # the echoed prompt's entries come first
                released = self.prompt_entries() + released
        self.loop.call_soon_threadsafe(self.events.put_nowait, (self.index, text, released, reason, len(tokens)))

    def name(self, token):
        """A token as logprobs show it: its text (`token_text`), or vLLM's "token_id:N"."""
        return f"token_id:{token}" if self.token_ids else token_text(
            self.encoder.encoding.decode_single_token_bytes(token))

    def entry(self, token, values):
        """A token's logprobs entry from (its log-probability, the top ids, theirs), or None."""
        logprob, top_ids, top_logprobs = (values or (None, [], []))[:3]
        return {"token": self.name(token), "logprob": None if values is None else protocol.finite(logprob),
                "top": None if values is None else [(self.name(int(t)), protocol.finite(p))
                                                    for t, p in zip(top_ids, top_logprobs)]}

    def prompt_entries(self):
        """The prompt's tokens' entries, with their offsets in the echoed text (the first token
        has no log-probability)."""
        prompt = self.sequence.prompt
        scored = TextStream(self.encoder.encoding.decode_single_token_bytes)
        entries = [self.entry(t, v) for t, v in zip(prompt, [None] + self.sequence.prompt_logprobs)]
        return scored.finish(prompt, entries)[1]

    def prompt_logprobs(self, n):
        """vLLM's prompt_logprobs: None for the first token, then per token {id: {logprob, rank,
        decoded_token}} of the token itself and the `n` most likely."""
        rows = [None]
        for token, (logprob, ids, values, rank) in zip(self.sequence.prompt[1:], self.sequence.prompt_logprobs):
            row = {str(token): protocol.ranked(logprob, int(rank), self.name(token))}
            for r, (t, value) in enumerate(zip(ids[:n], values[:n])):
                row.setdefault(str(int(t)), protocol.ranked(value, r + 1, self.name(int(t))))
            rows.append(row)
        return rows


def _skipped(token_bytes, special, token):
    return b"" if token == special else token_bytes(token)


def create_app(scheduler, *, model_name, encoder, hparams, api_key=None, public_metrics=False, max_body=MAX_BODY,
               docs=False):
    """The FastAPI app serving `scheduler`'s model as `model_name`; its engine thread starts and
    stops with the app. `api_key`: the key every route but /health needs (and /metrics unless
    `public_metrics`); `max_body`: the largest request body in bytes; `docs`: FastAPI's /docs,
    /redoc and /openapi.json. `app.state.draining` refuses new work."""
    paths = ("/docs", "/redoc", "/openapi.json") if docs else (None, None, None)
    app = FastAPI(title="tfgpt2", lifespan=lambda app: _Engine(scheduler),
                  **dict(zip(("docs_url", "redoc_url", "openapi_url"), paths)))
    app.state.draining, app.state.active, app.state.runs = False, 0, set()
    metrics = Metrics(scheduler)
    if api_key:
        open_paths = {"/health", "/metrics"} if public_metrics else {"/health"}
        app.add_middleware(RequireKey, key=api_key, open_paths=open_paths)
    app.add_exception_handler(HTTPException, no_route)

    @app.exception_handler(RequestError)
    async def refused(request, error):
        if request.url.path == COMPLETIONS:
            metrics.requests.labels(str(error.status)).inc()
        headers = ({"Retry-After": str(RETRY_AFTER)} if error.status == 429 else
                   {"Connection": "close"} if error.status == 413 else None)  # the rest of the body is not read
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    @app.exception_handler(ClientDisconnect)
    async def left_early(request, error):
        if request.url.path == COMPLETIONS:
            metrics.requests.labels("499").inc()
        log.warning("%s left before its request to %s was in whole", _client(request), request.url.path)
        return Response(status_code=499)  # not sent: nobody reads it

    @app.exception_handler(ClientLeft)
    async def left(request, error):  # `Run.watching` logged it
        return Response(status_code=499)

    _routes(app, metrics, model_name=model_name, encoder=encoder, n_ctx=hparams.n_ctx, max_body=max_body)
    _completions(app, scheduler, metrics, model_name=model_name, encoder=encoder, hparams=hparams, max_body=max_body)
    return app


def _routes(app, metrics, *, model_name, encoder, n_ctx, max_body):
    """Every route but the completions: health, metrics, models, the tokenizer's."""
    created = protocol.now()

    @app.get("/health")
    async def health():
        return Response(status_code=503 if app.state.draining else 200)

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return protocol.models(model_name, n_ctx, created)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        protocol.check_model(model_id, model_name)
        return protocol.model(model_name, n_ctx, created)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await read_json(request, max_body, functools.partial(tokenizer.tokenize, model_name=model_name,
                                                                     encoder=encoder, n_ctx=n_ctx))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await read_json(request, max_body, functools.partial(tokenizer.detokenize, model_name=model_name,
                                                                     encoder=encoder))

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return tokenizer.tokenizer_info(n_ctx)

    @app.get("/version")
    async def version():
        return tokenizer.version()


def _completions(app, scheduler, metrics, *, model_name, encoder, hparams, max_body):
    """`POST /v1/completions`: the request read and checked, its choices queued, then answered
    whole or streamed."""
    parse = functools.partial(protocol.parse, model_name=model_name, encoder=encoder, hparams=hparams,
                              capacity=scheduler.max_batch + scheduler.max_queue)

    @app.post(COMPLETIONS)
    async def completions(request: Request):
        app.state.active += 1  # until its choices are queued: the drain waits for them
        try:
            run = await _start(request)
        finally:
            app.state.active -= 1
        if run.c.stream:
            return StreamingResponse(run.streamed(scheduler, request), media_type="text/event-stream")
        return JSONResponse(await run.whole(scheduler, request))

    async def _start(request):
        if app.state.draining:
            raise RequestError("the server is shutting down", status=503, type="server_error",
                               code="service_unavailable")
        c = await read_json(request, max_body, parse)
        events, loop = asyncio.Queue(), asyncio.get_running_loop()
        choices = [Choice(index, prompt, c, encoder, events, loop) for prompt, index in c.choices()]
        try:
            scheduler.submit([choice.sequence for choice in choices])
        except QueueFull as e:
            raise RequestError(f"too many requests: {e}; retry later", status=429, type="rate_limit_error",
                               code="rate_limit_exceeded") from None
        metrics.prompt_tokens.inc(sum(map(len, c.prompts)))
        run = Run(c, choices, events, metrics, model_name)
        app.state.runs.add(run)  # until it ends (`Run.watching`): the drain's end cuts it off
        return run


def _client(request):
    return "%s:%d" % tuple(request.client) if request.client else "a client"


class ClientLeft(Exception):
    """The client of a request disconnected before its answer was whole."""


class Run:
    """A request's choices as they generate: events in, the response (or its stream) out. A
    client that disconnects first cancels them (their slots free at the next step)."""

    def __init__(self, completion, choices, events, metrics, model_name):
        self.c, self.choices, self.events, self.metrics = completion, choices, events, metrics
        self.id, self.created, self.model = protocol.new_id(), protocol.now(), model_name
        self.start = time.monotonic()
        self.open = len(choices)
        self.first, self.status = True, "200"
        self.last = {}  # each choice's last event with tokens: when it came
        self.made = {choice.index: 0 for choice in choices}  # each choice's tokens so far, as its events came

    async def next(self, watch):
        """The next event, (choice index, text, logprobs entries, finish reason, token count);
        ClientLeft where `watch` (the client's disconnect) comes first."""
        get = asyncio.ensure_future(self.events.get())
        done, _ = await asyncio.wait({get, watch}, return_when=asyncio.FIRST_COMPLETED)
        if get not in done:
            get.cancel()
            raise ClientLeft()
        index, _, _, reason, count = event = get.result()
        if reason == "cut":
            self.status = "503"
            raise RequestError("the server shut down before this answer was whole (--drain_timeout passed)",
                               status=503, type="server_error", code="service_unavailable")
        if count:
            self.made[index] += count
            self._latencies(index, count)
        if reason:
            self.open -= 1
        if reason == "error":
            self.status = "500"
            raise RequestError(f"choice {index}: the generation step failed (the server's log says why)",
                               status=500, type="server_error")
        return event

    async def whole(self, scheduler, request):
        """The response object, once every choice has ended."""
        texts = {choice.index: [] for choice in self.choices}
        entries = {choice.index: [] for choice in self.choices}
        reasons = {}
        async with self.watching(scheduler, request) as watch:
            while self.open:
                index, text, released, reason, _ = await self.next(watch)
                texts[index].append(text)
                entries[index] += released
                reasons[index] = reason
        scored = self.c.request.prompt_logprobs
        return protocol.completion(self.id, self.model, self.created, [
            protocol.choice(choice.index, "".join(texts[choice.index]), self._logprobs(entries[choice.index]),
                            reasons[choice.index], **({} if scored is None else {
                                "prompt_logprobs": choice.prompt_logprobs(scored)})) for choice in self.choices],
            self._usage())

    async def streamed(self, scheduler, request):
        """The server-sent events: a chunk per event with text, entries or an end, then the usage
        (where asked) and [DONE]; an error object where the step failed."""
        try:
            async with self.watching(scheduler, request) as watch:
                try:
                    while self.open:
                        index, text, released, reason, count = await self.next(watch)
                        if text or released or reason or count:  # a chunk per step with tokens, as vLLM's
                            yield _event(protocol.completion(self.id, self.model, self.created, [
                                protocol.choice(index, text, self._logprobs(released), reason)],
                                self._usage(index) if self.c.continuous_usage else None))
                except RequestError as error:
                    yield _event(error.body())
                    return
                if self.c.include_usage:
                    yield _event(protocol.completion(self.id, self.model, self.created, [], self._usage()))
                yield "data: [DONE]\n\n"
        except ClientLeft:  # `watching` logged it
            return

    @contextlib.asynccontextmanager
    async def watching(self, scheduler, request):
        """A task that ends when the client disconnects; on the way out, the request's status
        counted (a RequestError's by the app's handler), a client that left logged in one line,
        and choices still open (the client left, a failure) cancelled."""
        async def disconnected():
            while (await request.receive())["type"] != "http.disconnect":
                pass
        watch = asyncio.ensure_future(disconnected())
        try:
            yield watch
        except (ClientLeft, asyncio.CancelledError):  # CancelledError: Starlette's stream saw it first
            self.metrics.requests.labels("499").inc()
            log.warning("%s left before its answer %s was whole: %d of its %d completions cancelled",
                        _client(request), self.id, self.open, len(self.choices))
            raise
        else:
            self.metrics.requests.labels(self.status).inc()
            self.metrics.e2e.observe(time.monotonic() - self.start)
        finally:
            watch.cancel()
            request.app.state.runs.discard(self)
            if self.open:
                scheduler.cancel([choice.sequence for choice in self.choices])

    def _latencies(self, index, count):
        """The request's first token, a choice's time in the queue (at its first tokens) and the
        time between its tokens (`count` new ones) into their histograms."""
        now = time.monotonic()
        if self.first:
            self.first = False
            self.metrics.first_token.observe(now - self.start)
        if index in self.last:
            for _ in range(count):
                self.metrics.inter_token.observe((now - self.last[index]) / count)
        else:
            sequence = self.choices[index].sequence
            self.metrics.queue_time.observe(sequence.admitted - sequence.submitted)
        self.last[index] = now

    def cut_off(self):
        """End the answer with a 503 (the drain's time is over); its choices are cancelled."""
        self.events.put_nowait((None, "", [], "cut", 0))

    def _logprobs(self, entries):
        return None if self.c.logprobs is None else protocol.logprobs_object(entries, self.c.logprobs)

    def _usage(self, index=None):
        """The request's usage, or (vLLM's continuous usage) choice `index`'s so far."""
        if index is not None:
            return protocol.usage(len(self.c.prompts[index // self.c.n]), self.made[index])
        return protocol.usage(sum(map(len, self.c.prompts)), sum(choice.tokens for choice in self.choices))


def _event(data):
    return f"data: {json.dumps(data)}\n\n"


class _Engine:
    """The app's lifespan: the scheduler's engine thread, started and stopped with it."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    async def __aenter__(self):
        self.thread = threading.Thread(target=self.scheduler.run, name="tfgpt2-engine", daemon=True)
        self.thread.start()

    async def __aexit__(self, *exc):
        self.scheduler.close()
        await asyncio.to_thread(self.thread.join)
        await asyncio.to_thread(self.scheduler.join)



def serve(model, encoder, *, model_name, host="127.0.0.1", port=8000, max_batch=16, max_queue=256, chunk=64,
          steps=1, prefix_blocks=64, log_level="warning", ready=None, api_key=None, public_metrics=False,
          max_body=MAX_BODY, request_timeout=30, drain_timeout=30, docs=False, warm_up=True):
    """Serve `model` as `model_name` on host:port until a signal drains the server
    (`server.Server`): `max_batch` slots, `max_queue` completions waiting, prefill chunks of up
    to `chunk` tokens, up to `steps` tokens per decode call, a prefix cache of `prefix_blocks`
    blocks (`scheduler.Scheduler`); `api_key`, `public_metrics`, `max_body` and `docs` as
    `create_app` takes them; a request must be in whole within `request_timeout` seconds
    (`server.Protocol`), and the drain ends within `drain_timeout`. With `warm_up`, the
    programs that stand in for every step are compiled before the port listens
    (`Scheduler.warm_up`), so that no request waits on a compile. `ready(seconds)` is called once
    the port listens, with the warm-up's seconds (None: none)."""
    scheduler = Scheduler(model, max_batch=max_batch, max_queue=max_queue, chunk=chunk, steps=steps,
                          eot=encoder.eot_token, prefix_blocks=prefix_blocks, vocabulary=Vocabulary.of(encoder))
    if warm_up:
        seconds = scheduler.warm_up()
        log.info("warm-up: %d programs compiled in %.1f s", len(scheduler.slots.programs), seconds)
    app = create_app(scheduler, model_name=model_name, encoder=encoder, hparams=model.hparams, api_key=api_key,
                     public_metrics=public_metrics, max_body=max_body, docs=docs)
    settings = config(app, host=host, port=port, log_level=log_level, request_timeout=request_timeout)
    Server(settings, app, scheduler, drain_timeout=drain_timeout,
           ready=ready and (lambda: ready(scheduler.warmed))).run()
