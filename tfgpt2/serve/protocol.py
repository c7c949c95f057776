"""OpenAI's completions API as the server speaks it, with vLLM's extras: a request's JSON read
into a `Completion` (types here, every range by the request rules, `decoding.request`, so that a
400 says what `tfgpt2.generate` would say), and the response, stream chunk and error objects.

Fields: OpenAI's `model`, `prompt` (a string, a list of strings, token ids or lists of them),
`max_tokens` (default 16; 0 with `echo`: the prompt alone, with its log-probabilities where
asked), `temperature`, `top_p`, `n`, `stop` (a string or a list of up to
`decoding.request.MAX_STOPS`: more than OpenAI's 4, for evaluation tasks), `seed`,
`presence_penalty`, `frequency_penalty`, `logit_bias`, `logprobs` (0-5), `echo`, `stream`,
`stream_options` (`include_usage`, and vLLM's `continuous_usage_stats`: usage in every chunk),
`user` (ignored), `best_of` (= n) and `suffix` (null only); vLLM's `top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `min_tokens`, `stop_token_ids` (token ids, or token-id
lists of up to `decoding.slots.STOP_TOKENS`), `include_stop_str_in_output`, `prompt_logprobs`
(not streamed), `truncate_prompt_tokens`, `return_tokens_as_token_ids`, `add_special_tokens`
and `spaces_between_special_tokens` (GPT-2's tokenizer adds no token and puts no space either
way) and `skip_special_tokens` (under `ignore_eos`, the <|endoftext|> tokens run past are left out
of the text, as vLLM's, unless false: then the text shows them, as every tfgpt2 door does; stop
strings need it false there, being matched on that text); tfgpt2's `context_keep` (go past n_ctx from the
last that many tokens). vLLM's fields that tfgpt2 cannot honour (`UNSUPPORTED`) are refused by
name, as is any other field.
"""
import dataclasses
import difflib
import math
import re
import time
import uuid

from .. import seeds
from ..decoding.request import check_prompts, check_request, check_value, check_window, json_logit_bias, json_stop
from ..decoding.slots import STOP_TOKENS
from ..ranges import Range, shown

OPENAI = {"model", "prompt", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "presence_penalty",
          "frequency_penalty", "logit_bias", "logprobs", "echo", "stream", "stream_options", "user", "best_of",
          "suffix"}
VLLM = {"top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids",
        "include_stop_str_in_output", "prompt_logprobs", "truncate_prompt_tokens", "return_tokens_as_token_ids",
        "add_special_tokens", "spaces_between_special_tokens", "skip_special_tokens"}
FIELDS = OPENAI | VLLM | {"context_keep"}
UNSUPPORTED = {  # vLLM's fields that tfgpt2 does not honour: (the value that asks for nothing, what they are)
    "use_beam_search": (False, "beam search"), "length_penalty": (1, "beam search's length penalty"),
    "priority": (0, "priority scheduling"), "allowed_token_ids": (None, "a token allow-list"),
    "bad_words": (None, "banned words"), "response_format": (None, "structured output"),
    "structured_outputs": (None, "structured output"), "guided_json": (None, "guided decoding"),
    "guided_regex": (None, "guided decoding"), "guided_choice": (None, "guided decoding"),
    "guided_grammar": (None, "guided decoding"), "guided_decoding_backend": (None, "guided decoding"),
    "guided_whitespace_pattern": (None, "guided decoding"), "logits_processors": (None, "logits processors"),
    "prompt_embeds": (None, "prompt embeddings"), "cache_salt": (None, "a salted prefix cache"),
    "kv_transfer_params": (None, "disaggregated serving"), "vllm_xargs": (None, "vLLM's extension arguments"),
    "request_id": (None, "request ids"), "return_token_ids": (False, "token ids in the response")}
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
    where none was given), `echo`, `generate` (false for `max_tokens` 0: the prompt alone),
    `stream`, `include_usage`, `continuous_usage`, `token_ids` (logprobs' tokens as
    "token_id:N"), `skip_special` (under `ignore_eos`: the text leaves out the <|endoftext|>
    tokens it runs past, as vLLM's skip_special_tokens)."""

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
    def scored(self):
        """Whether the prompt's log-probabilities are asked for (echoed, or vLLM's prompt_logprobs)."""
        return self.request.prompt_logprobs is not None or (self.echo and self.logprobs is not None)


def parse(body, *, model_name, encoder, hparams, capacity):
    """The request `body` (parsed JSON) as a `Completion`, or RequestError. `capacity`: the most
    choices one request may ask for (slots + queue)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    _known(body)
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
    flags = {name: _flag(name, get(name, default)) for name, default in (
        ("stream", False), ("echo", False), ("ignore_eos", False), ("include_stop_str_in_output", False),
        ("return_tokens_as_token_ids", False), ("add_special_tokens", True), ("skip_special_tokens", True),
        ("spaces_between_special_tokens", True))}
    c.stream, c.echo, c.token_ids = flags["stream"], flags["echo"], flags["return_tokens_as_token_ids"]
    c.texts, c.prompts = _truncated(*_prompts(prompt, encoder), get("truncate_prompt_tokens"), hparams.n_ctx)
    c.include_usage, c.continuous_usage = _stream_options(get("stream_options"), c.stream)
    max_tokens = get("max_tokens", 16)
    c.generate = not (c.echo and max_tokens == 0 and type(max_tokens) is int)  # vLLM's echo alone
    c.request = _check(c.prompts, get, hparams, max_tokens if c.generate else 1, flags)
    if c.stream and c.request.prompt_logprobs is not None:
        raise RequestError("prompt_logprobs are not streamed: ask without stream, or with echo and logprobs",
                           param="prompt_logprobs")
    c.skip_special = flags["skip_special_tokens"] and flags["ignore_eos"]
    if c.skip_special and c.request.stop:
        raise RequestError("stop strings with ignore_eos need skip_special_tokens false: they are matched on the "
                           "text with the <|endoftext|> tokens it runs past shown", param="stop")
    return c


def _known(body):
    """A 400 naming the first field this server does not take: vLLM's that it cannot honour
    (`UNSUPPORTED`; allowed at the value that asks for nothing), then any other."""
    for name in sorted(set(body) - FIELDS):
        if name in UNSUPPORTED:
            off, what = UNSUPPORTED[name]
            if body[name] is None or (body[name] == off and isinstance(body[name], bool) == isinstance(off, bool)):
                continue
            raise RequestError(f"{name} ({what}) is not supported by this server", param=name)
        near = difflib.get_close_matches(name, FIELDS | set(UNSUPPORTED), n=1)
        raise RequestError(f"unknown field {shown(name)}" + (f" (did you mean {near[0]}?)" if near else ""),
                           param=name[:40])


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


def _check(prompts, get, hparams, max_tokens, flags):
    """The request rules (`decoding.request`, which `tfgpt2.generate` asks too) over the prompts,
    max_tokens, context_keep and the sampling and stopping fields, read with the JSON readers that
    bulk lines use too: the `Request`, or a 400 with the rule's message. <|endoftext|> ends a
    choice, as OpenAI's, unless `ignore_eos`."""
    try:
        request = check_request(
            n_vocab=hparams.n_vocab, n_ctx=hparams.n_ctx, names=API_NAMES, length=max_tokens,
            context_keep=get("context_keep"), temperature=get("temperature", 1.0), top_k=get("top_k", 0),
            top_p=get("top_p", 1.0), min_p=get("min_p", 0.0), seed=get("seed"),
            repetition_penalty=get("repetition_penalty", 1.0), presence_penalty=get("presence_penalty", 0.0),
            frequency_penalty=get("frequency_penalty", 0.0), logit_bias=json_logit_bias(get("logit_bias")),
            stop=json_stop(get("stop")), stop_token_ids=_stop_token_ids(get("stop_token_ids")),
            min_tokens=get("min_tokens", 0), include_stop_str_in_output=flags["include_stop_str_in_output"],
            logprobs=get("logprobs"), prompt_logprobs=get("prompt_logprobs"), stop_at_eot=not flags["ignore_eos"])
        prompts = check_prompts(prompts, hparams.n_vocab, API_NAMES["prompts"])
        check_window(max(map(len, prompts)), request.length, hparams.n_ctx, context_keep=request.context_keep,
                     names=API_NAMES)
    except ValueError as e:
        zero = max_tokens == 0 and type(max_tokens) is int and str(e).startswith("max_tokens")
        message = str(e) + (" (0 only with echo: the prompt alone)" if zero else "")
        raise RequestError(message, param=_param(str(e))) from None
    return request


def _stop_token_ids(value):
    """vLLM's stop_token_ids (token ids; here also token-id lists, each a sequence that stops),
    each sequence at most STOP_TOKENS long (what a slot holds); the ids are the request rules' to
    check."""
    if isinstance(value, list):
        for n, sequence in enumerate(value):
            if isinstance(sequence, list) and len(sequence) > STOP_TOKENS:
                raise ValueError(f"stop_token_ids sequence {n} must be at most {STOP_TOKENS} tokens, "
                                 f"got {len(sequence)}")
    return value


def _param(message):
    """The field a request rule's message names first ("max_tokens must be ...", "prompt 1: ...")."""
    word = re.match(r"\w*", message).group()
    return "prompt" if word == "prompts" else word or None


def _flag(name, value):
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {shown(value)}", param=name.split(".")[0])
    return value


def _stream_options(options, stream):
    """(include_usage, continuous_usage_stats) of stream_options; the second only with the first,
    as vLLM's."""
    if options is None:
        return False, False
    if not stream:
        raise RequestError("stream_options is only allowed with stream: true", param="stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise RequestError('stream_options must be {"include_usage": true or false, "continuous_usage_stats": '
                           'true or false}', param="stream_options")
    usage, continuous = (_flag("stream_options." + name, options.get(name, False))
                         for name in ("include_usage", "continuous_usage_stats"))
    return usage, usage and continuous


def _truncated(texts, prompts, keep, n_ctx):
    """vLLM's truncate_prompt_tokens: each prompt's last `keep` tokens (its text, for echo, then
    read from them)."""
    if keep is None:
        return texts, prompts
    keep = _field("truncate_prompt_tokens", keep, Range(int, 1, n_ctx))
    return ([t if len(p) <= keep else None for t, p in zip(texts, prompts)], [p[-keep:] for p in prompts])


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


def choice(index, text, logprobs, finish_reason, **extra):
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason, **extra}


def ranked(logprob, rank, token):
    """An entry of vLLM's prompt_logprobs."""
    return {"logprob": finite(logprob), "rank": rank, "decoded_token": token}


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
