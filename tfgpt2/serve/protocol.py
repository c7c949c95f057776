"""OpenAI's completions API as the server speaks it: a request's JSON read into a `Completion`
(types here, every range by the request rules, `decoding.request`, so that a 400 says what
`tfgpt2.generate` would say), and the response, stream chunk and error objects.

Fields: OpenAI's `model`, `prompt` (a string, a list of strings, token ids or lists of them),
`max_tokens` (default 16), `temperature`, `top_p`, `n`, `stop` (a string or a list of up to
`decoding.request.MAX_STOPS`: more than OpenAI's 4, for evaluation tasks), `seed`,
`presence_penalty`, `frequency_penalty`, `logit_bias`, `logprobs` (0-5), `echo`, `stream`,
`stream_options.include_usage`, `user` (ignored), `best_of` (= n) and `suffix` (null only);
tfgpt2's `top_k`, `min_p`, `repetition_penalty` and `context_keep` (go past n_ctx from the last
that many tokens). Any other field is refused, naming it.
"""
import dataclasses
import math
import re
import time
import uuid

from .. import seeds
from ..decoding.request import check_prompts, check_request, check_value, check_window, json_logit_bias, json_stop
from ..ranges import Range, shown
FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "presence_penalty",
          "frequency_penalty", "logit_bias", "logprobs", "echo", "stream", "stream_options", "user", "best_of",
          "suffix", "top_k", "min_p", "repetition_penalty", "context_keep"}
API_NAMES = {"prompts": "prompt", "length": "max_tokens"}  # the request rules' fields as this API names them


class RequestError(Exception):
    """A request the server answers with an error object: `status` (400, 401, 404, 405, 413,
    429, 503), OpenAI's `type` and `code`, and the `param` at fault (every 400 names one)."""

    def __init__(self, message, *, status=400, param=None, type="invalid_request_error", code=None):
        super().__init__(message)
        self.status, self.param, self.type, self.code = status, param, type, code

    def body(self):
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


class Completion:
    """A checked completions request: `prompts` (token lists) and their `texts` (for `echo`),
    `n` choices each, `request` (the `decoding.request.Request` of every choice; its seed drawn
    where none was given), `echo`, `stream`, `include_usage`."""

    def choices(self):
        """(prompt index, choice index) of every choice, in the response's order."""
        return [(p, p * self.n + j) for p in range(len(self.prompts)) for j in range(self.n)]

    def request_of(self, index):
        """The request of choice `index`: its seed the request's + index (`seeds.seed_of`:
        choices differ, requests repeat, and choice i is `tfgpt2.generate`'s row i)."""
        return dataclasses.replace(self.request, seed=seeds.seed_of(self.request.seed, index))

    @property
    def logprobs(self):
        return self.request.logprobs

    @property
    def max_tokens(self):
        return self.request.length


def parse(body, *, model_name, encoder, hparams, capacity):
    """The request `body` (parsed JSON) as a `Completion`, or RequestError. `capacity`: the most
    choices one request may ask for (slots + queue)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise RequestError(f"unknown field {shown(unknown[0])} (this server takes {', '.join(sorted(FIELDS))})",
                           param=unknown[0][:40])
    get = {k: v for k, v in body.items() if v is not None}.get  # a null means the default, as OpenAI's
    check_model(get("model"), model_name)
    c = Completion()
    c.n = _field("n", get("n", 1), Range(int, 1, 2**31 - 1))
    if get("best_of", c.n) != c.n or get("suffix") is not None:
        raise RequestError("best_of (other than n) and suffix are not supported",
                           param="best_of" if get("suffix") is None else "suffix")
    prompt = get("prompt", "<|endoftext|>")
    count = len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else 1
    if count * c.n > capacity:  # before a prompt is encoded: a million prompts cost nothing
        raise RequestError(f"prompts x n = {count * c.n} completions; one request may ask for at most "
                           f"{capacity} (--max_batch + --max_queue)", param="n" if c.n > 1 else "prompt")
    c.texts, c.prompts = _prompts(prompt, encoder)
    c.stream, c.echo = (_flag(name, get(name, False)) for name in ("stream", "echo"))
    c.include_usage = _stream_options(get("stream_options"), c.stream)
    c.request = _check(c.prompts, get, hparams)
    return c


def check_model(model, model_name):
    """A 404 unless `model` is the served model's id."""
    if model != model_name:
        name = model if isinstance(model, str) and len(model) <= 80 else shown(model)
        raise RequestError(f"The model `{name}` does not exist; this server serves `{model_name}`",
                           status=404, param="model", code="model_not_found")


def _field(name, value, value_range):
    try:
        return check_value(name, value, value_range=value_range)
    except ValueError as e:
        raise RequestError(str(e), param=name) from None


def _check(prompts, get, hparams):
    """The request rules (`decoding.request`, which `tfgpt2.generate` asks too) over the prompts,
    max_tokens, context_keep and the sampling fields, read with the JSON readers that bulk lines
    use too: the `Request`, or a 400 with the rule's message. <|endoftext|> ends a choice, as
    OpenAI's."""
    try:
        request = check_request(
            n_vocab=hparams.n_vocab, n_ctx=hparams.n_ctx, names=API_NAMES, length=get("max_tokens", 16),
            context_keep=get("context_keep"), temperature=get("temperature", 1.0), top_k=get("top_k", 0),
            top_p=get("top_p", 1.0), min_p=get("min_p", 0.0), seed=get("seed"),
            repetition_penalty=get("repetition_penalty", 1.0), presence_penalty=get("presence_penalty", 0.0),
            frequency_penalty=get("frequency_penalty", 0.0), logit_bias=json_logit_bias(get("logit_bias")),
            stop=json_stop(get("stop")), logprobs=get("logprobs"), stop_at_eot=True)
        prompts = check_prompts(prompts, hparams.n_vocab, API_NAMES["prompts"])
        check_window(max(map(len, prompts)), request.length, hparams.n_ctx, context_keep=request.context_keep,
                     names=API_NAMES)
    except ValueError as e:
        raise RequestError(str(e), param=_param(str(e))) from None
    return request


def _param(message):
    """The field a request rule's message names first ("max_tokens must be ...", "prompt 1: ...")."""
    word = re.match(r"\w*", message).group()
    return "prompt" if word == "prompts" else word or None


def _flag(name, value):
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {shown(value)}", param=name.split(".")[0])
    return value


def _stream_options(options, stream):
    if options is None:
        return False
    if not stream:
        raise RequestError("stream_options is only allowed with stream: true", param="stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise RequestError('stream_options must be {"include_usage": true or false}', param="stream_options")
    return _flag("stream_options.include_usage", options.get("include_usage", False))


def _prompts(prompt, encoder):
    """([text or None], [token list]) of the prompt in any of its four forms. Strings are
    encoded with <|endoftext|> as the special token, as OpenAI's API does."""
    def ids(tokens, where):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise RequestError(f"{where} must be a string or a list of token ids (integers)", param="prompt")
        return list(tokens)
    if isinstance(prompt, str):
        return [prompt], [encoder.encode(prompt, allowed_special="all")]
    if not isinstance(prompt, list) or not prompt:
        raise RequestError("prompt must be a string, a list of strings, a list of token ids or a list of such lists",
                           param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt), [encoder.encode(p, allowed_special="all") for p in prompt]
    if all(isinstance(p, list) for p in prompt):
        return [None] * len(prompt), [ids(p, f"prompt {n}") for n, p in enumerate(prompt)]
    return [None], [ids(prompt, "prompt")]


# ---- responses ----------------------------------------------------------------------------

def new_id():
    return f"cmpl-{uuid.uuid4().hex}"


def completion(id, model, created, choices, usage):
    """The response object; `choices` as `choice` makes them."""
    return {"id": id, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": usage}


def choice(index, text, logprobs, finish_reason):
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def usage(prompt_tokens, completion_tokens):
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def logprobs_object(entries, n):
    """OpenAI's logprobs of a choice from TextStream entries: tokens, token_logprobs,
    top_logprobs (the n most likely, token text -> log-probability) and text_offset."""
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [None if e["top"] is None else dict(e["top"][:n]) for e in entries],
            "text_offset": [e["offset"] for e in entries]}


def models(model_name, n_ctx, created):
    return {"object": "list", "data": [model(model_name, n_ctx, created)]}


def model(model_name, n_ctx, created):
    """The model object of `GET /v1/models/{id}` (and of the list)."""
    return {"id": model_name, "object": "model", "created": created, "owned_by": "tfgpt2", "max_model_len": n_ctx}


def now():
    return int(time.time())


def finite(x):
    """A log-probability as JSON can carry it (-inf as a very large negative number)."""
    return float(x) if math.isfinite(x) else -9999.0
