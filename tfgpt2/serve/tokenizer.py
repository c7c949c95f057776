"""vLLM's tokenizer endpoints, for clients that count tokens or score text through the server
with no tokenizer of their own: the requests read and the answers made.

- `POST /tokenize` `{"model"?, "prompt": text, "add_special_tokens"?, "return_token_strs"?}` ->
  `{"count", "max_model_len", "tokens", "token_strs"}` (the ids that a completion's prompt
  reads: `<|endoftext|>` is the special token; GPT-2 adds no token of its own)
- `POST /detokenize` `{"model"?, "tokens": ids}` -> `{"prompt": text}`
- `GET /tokenizer_info`: the tokenizer's configuration as Hugging Face's `GPT2Tokenizer`
  writes it (`tokenizer_config.json`), `GET /version`: `{"version"}`.
"""
import importlib.metadata

from ..decoding.request import shown
from ..encoder import EOT
from .protocol import RequestError, check_model


def tokenize(body, *, model_name, encoder, n_ctx):
    """The answer to a /tokenize request `body` (parsed JSON), or RequestError."""
    fields = _fields(body, {"model", "prompt", "add_special_tokens", "return_token_strs"}, model_name)
    prompt = fields.get("prompt")
    if not isinstance(prompt, str):
        raise RequestError(f"prompt must be a string, got {shown(prompt)}", param="prompt")
    for name in ("add_special_tokens", "return_token_strs"):
        if not isinstance(fields.get(name, False), bool):
            raise RequestError(f"{name} must be true or false, got {shown(fields[name])}", param=name)
    tokens = encoder.encode(prompt, allowed_special="all")
    return {"count": len(tokens), "max_model_len": n_ctx, "tokens": tokens,
            "token_strs": [encoder.decoder[t] for t in tokens] if fields.get("return_token_strs") else None}


def detokenize(body, *, model_name, encoder):
    """The answer to a /detokenize request `body`, or RequestError."""
    tokens = _fields(body, {"model", "tokens"}, model_name).get("tokens")
    if not isinstance(tokens, list):
        raise RequestError(f"tokens must be a list of token ids, got {shown(tokens)}", param="tokens")
    bad = [t for t in tokens if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < encoder.n_vocab]
    if bad:
        raise RequestError(f"tokens must be token ids in [0, n_vocab={encoder.n_vocab}), got {shown(bad[0])}",
                           param="tokens")
    return {"prompt": encoder.decode(tokens)}


def _fields(body, known, model_name):
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    unknown = sorted(set(body) - known)
    if unknown:
        raise RequestError(f"unknown field {shown(unknown[0])} (this endpoint takes {', '.join(sorted(known))})",
                           param=unknown[0][:40])
    if body.get("model") is not None:
        check_model(body["model"], model_name)
    return body


def tokenizer_info(n_ctx):
    return {"tokenizer_class": "GPT2Tokenizer", "model_max_length": n_ctx, "bos_token": EOT, "eos_token": EOT,
            "unk_token": EOT, "pad_token": None, "add_prefix_space": False, "add_bos_token": False,
            "errors": "replace", "clean_up_tokenization_spaces": False}


def version():
    try:
        return {"version": importlib.metadata.version("tfgpt2")}
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that pip has not installed
        return {"version": "unknown"}
