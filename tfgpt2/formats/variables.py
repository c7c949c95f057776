"""The variables a GPT-2 of given hparams owns: the one table of their checkpoint names and
shapes (what `GPT2` builds, OpenAI's checkpoints hold and every format converts), and their
counts (`tfgpt2 params`)."""
import math


def variable_shapes(hparams, *, tie_embeddings=True):
    """Checkpoint name -> shape of every variable `GPT2(hparams)` owns, without building it."""
    nx, hp = hparams.n_embd, hparams
    shapes = {"model/wpe": [hp.n_ctx, nx], "model/wte": [hp.n_vocab, nx]}
    block = {"ln_1/g": [nx], "ln_1/b": [nx],
             "attn/c_attn/w": [1, nx, 3 * nx], "attn/c_attn/b": [3 * nx],
             "attn/c_proj/w": [1, nx, nx], "attn/c_proj/b": [nx],
             "ln_2/g": [nx], "ln_2/b": [nx],
             "mlp/c_fc/w": [1, nx, 4 * nx], "mlp/c_fc/b": [4 * nx],
             "mlp/c_proj/w": [1, 4 * nx, nx], "mlp/c_proj/b": [nx]}
    for layer in range(hp.n_layer):
        shapes.update({f"model/h{layer}/{name}": shape for name, shape in block.items()})
    shapes.update({"model/ln_f/g": [nx], "model/ln_f/b": [nx]})
    if not tie_embeddings:
        shapes["model/out_head"] = [hp.n_vocab, nx]
    return shapes


def count_params(model):
    """Parameters of a built model, each variable counted once (the tied `wte` included)."""
    unique = {id(v): v for v in model.weights}
    return sum(math.prod(v.shape) for v in unique.values())


def breakdown(hparams):
    """(part, count) rows: embeddings, one block, all blocks, final norm, output layer, totals."""
    shapes = variable_shapes(hparams)
    size = {name: math.prod(shape) for name, shape in shapes.items()}
    block = sum(n for name, n in size.items() if name.startswith("model/h0/"))
    tied = sum(size.values())
    head = hparams.n_vocab * hparams.n_embd
    return [
        ("token embedding wte", size["model/wte"]),
        ("position embedding wpe", size["model/wpe"]),
        ("one block", block),
        (f"{hparams.n_layer} blocks", block * hparams.n_layer),
        ("final norm ln_f", size["model/ln_f/g"] + size["model/ln_f/b"]),
        ("output layer, tied to wte", 0),
        ("output layer, untied", head),
        ("total, tied", tied),
        ("total, untied", tied + head),
    ]
