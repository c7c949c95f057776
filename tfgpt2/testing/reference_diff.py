"""tfgpt2 beside OpenAI's original code (run by `reference.Reference`) on the same tokens:
how far apart the logits, `present` and each block's output are, whether the top-5 tokens
agree at every position, and greedy continuations from both, timed.
Shared by `tfgpt2 compare` (`cli/compare.py`) and `notebooks/compare_with_reference.ipynb`.

"max rel" is max |ours - theirs| / max |theirs| over a whole tensor, not a per-element ratio,
which blows up wherever the reference is near zero.
"""
import dataclasses
import re
import time

import numpy as np

# Correct fp32 implementations differ by 1e-4..2e-4 in logits with std-0.1 weights (issue 2).
ATOL = 5e-4
# Each block's output is bounded relative to its size: the residual stream grows to the
# hundreds (thousands in the real 124M), where fp32 rounding alone exceeds ATOL.
HIDDEN_RTOL = 1e-5


@dataclasses.dataclass
class Diff:
    abs: float
    rel: float


def diff(ours, theirs):
    """Max abs and max rel difference of two arrays of the same shape."""
    d = float(np.max(np.abs(ours - theirs)))
    scale = float(np.max(np.abs(theirs)))
    return Diff(d, d / scale if scale else (np.inf if d else 0.0))


@dataclasses.dataclass
class Row:
    """One line of the table: `kind` ('abs' or 'rel') says which difference `bound` limits."""
    name: str
    diff: Diff
    kind: str
    bound: float

    @property
    def ok(self):
        return getattr(self.diff, self.kind) <= self.bound


@dataclasses.dataclass
class Comparison:
    """Both implementations' outputs ({'logits', 'present', 'hidden'} as numpy) and greedy
    continuations (prompt included), keyed 'tfgpt2' and 'reference'; seconds of each forward
    pass ('tfgpt2', 'reference') and greedy loop ('tfgpt2 greedy', 'reference greedy')."""
    tokens: np.ndarray
    outputs: dict
    greedy: dict
    seconds: dict
    atol: float = ATOL
    hidden_rtol: float = HIDDEN_RTOL

    def rows(self):
        """logits and present, then each block's present and output (its residual stream)."""
        ours, theirs = self.outputs["tfgpt2"], self.outputs["reference"]
        rows = [Row(key, diff(ours[key], theirs[key]), "abs", self.atol) for key in ("logits", "present")]
        for layer in range(ours["hidden"].shape[1]):
            rows.append(Row(f"h{layer} present", diff(ours["present"][:, layer], theirs["present"][:, layer]),
                            "abs", self.atol))
            rows.append(Row(f"h{layer} output", diff(ours["hidden"][:, layer], theirs["hidden"][:, layer]),
                            "rel", self.hidden_rtol))
        return rows

    @property
    def ok(self):
        return all(row.ok for row in self.rows())

    def first_differing_layer(self):
        """'h<i>' for the first block whose present or output is out of tolerance, else None."""
        return next((row.name.split()[0] for row in self.rows() if row.name[0] == "h" and not row.ok), None)

    def top5(self):
        """(ours, theirs, agree): top-5 ids [batch, T, 5] in logit order, and where they match."""
        ours, theirs = (np.argsort(-self.outputs[k]["logits"], axis=-1, kind="stable")[..., :5]
                        for k in ("tfgpt2", "reference"))
        return ours, theirs, np.all(ours == theirs, axis=-1)


def _timed(fn):
    """fn() once to warm up, then again timed: (result, seconds)."""
    fn()
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def greedy(model, tokens, length):
    """tfgpt2's greedy continuation: the compiled sampler at top_k=1."""
    from ..sample import sample_sequence  # TensorFlow: not before the tool has checked its flags
    return sample_sequence(model=model, context=tokens, length=length, top_k=1)


def reference_greedy(ref, tokens, length):
    """The original `sample_sequence` with top_k=1, one row at a time (its `top_p_logits` does
    not broadcast over a batch of more than one): (tokens, seconds of its sess.run calls)."""
    rows, seconds = [], 0.0
    for row in tokens:
        out, runs = ref.sample_sequence(context=row[None], length=length, top_k=1, seed=0)
        rows.append(out[0])
        seconds += runs[0]
    return np.stack(rows), seconds


def compare(model, ref, tokens, *, length=0, atol=ATOL, hidden_rtol=HIDDEN_RTOL):
    """Run `model` (a built GPT2, perturbed or not) and `ref` (a `Reference` on the same
    folder) on `tokens` [batch, T], and each greedily for `length` more tokens."""
    tokens = np.asarray(tokens, np.int32)
    ours, ours_s = _timed(lambda: {k: v.numpy() for k, v in model(tokens, return_hidden=True).items()})
    theirs, theirs_s = _timed(lambda: ref.model(tokens, hidden=True))
    ours_greedy, ours_greedy_s = _timed(lambda: greedy(model, tokens, length)) if length else (tokens, 0.0)
    theirs_greedy, theirs_greedy_s = reference_greedy(ref, tokens, length) if length else (tokens, 0.0)
    return Comparison(
        tokens=tokens, outputs={"tfgpt2": ours, "reference": theirs},
        greedy={"tfgpt2": ours_greedy, "reference": theirs_greedy},
        seconds={"tfgpt2": ours_s, "reference": theirs_s,
                 "tfgpt2 greedy": ours_greedy_s, "reference greedy": theirs_greedy_s},
        atol=atol, hidden_rtol=hidden_rtol)


def perturb(model, name, delta=1.0):
    """Add `delta` to the first element of the variable with checkpoint name `name`, in memory
    (a self-check: the comparison must then fail and name that variable's layer)."""
    variables = {v.path: v for v in model.weights}
    if name not in variables:
        raise ValueError(f"no variable {name!r}; the model has {_names(variables, model.hparams.n_layer)}")
    value = variables[name].numpy()
    value.flat[0] += delta
    variables[name].assign(value)


def _names(variables, n_layer):
    """The variable names in short: the blocks' once, as model/h{0..n-1}/{...}."""
    block = sorted(name.split("/", 2)[2] for name in variables if name.startswith("model/h0/"))
    rest = sorted(name for name in variables if not re.match(r"model/h\d+/", name))
    return f"{', '.join(rest)} and model/h{{0..{n_layer - 1}}}/{{{', '.join(block)}}}"


def table(comparison):
    """The difference table as text lines."""
    lines = [f"{'tensor':<14}{'max abs':>10}{'max rel':>10}  {'tolerance':<14}ok"]
    for row in comparison.rows():
        lines.append(f"{row.name:<14}{row.diff.abs:>10.2e}{row.diff.rel:>10.2e}  "
                     f"{row.kind + ' <= ' + format(row.bound, '.0e'):<14}{'yes' if row.ok else 'NO'}")
    return lines


def report(comparison, decode):
    """The whole report as text: table, first differing layer, top-5 agreement per position,
    greedy text from both, times, verdict. `decode` maps a list of ids to text."""
    c, s = comparison, comparison.seconds
    layer = c.first_differing_layer()
    lines = table(c) + [""]
    if layer:
        lines.append(f"first layer that differs: {layer}")
    elif not c.ok:
        lines.append("first layer that differs: none of the blocks; the difference is after them (ln_f or the output layer)")
    else:
        lines.append("first layer that differs: none")
    ours, theirs, agree = c.top5()
    lines += ["", f"top-5 tokens agree at {agree.sum()} of {agree.size} positions",
              f"{'row':>3} {'pos':>3}  {'token':<16}{'top-5 ids (tfgpt2)':<40}agree"]
    for (b, t), same in np.ndenumerate(agree):
        lines.append(f"{b:>3} {t:>3}  {decode([c.tokens[b, t]])!r:<16}{str(ours[b, t].tolist()):<40}"
                     + ("yes" if same else f"NO: reference {theirs[b, t].tolist()}"))
    length = c.greedy["tfgpt2"].shape[1] - c.tokens.shape[1]
    if length:
        lines += ["", f"greedy continuation, {length} tokens:"]
        for b in range(len(c.tokens)):
            for name in ("tfgpt2", "reference"):
                lines.append(f"  {name:<10} {decode(c.greedy[name][b].tolist())!r}")
        same = np.array_equal(c.greedy["tfgpt2"], c.greedy["reference"])
        lines.append(f"  same tokens: {'yes' if same else 'NO'}")
    lines += ["", f"time: forward pass tfgpt2 {s['tfgpt2']:.3f} s (eager), reference {s['reference']:.3f} s "
                  "(sess.run and the pipe to its process)"]
    if length:
        lines.append(f"      greedy {length} tokens tfgpt2 {s['tfgpt2 greedy']:.3f} s (XLA, compiled beforehand), "
                     f"reference {s['reference greedy']:.3f} s (sess.run of sample_sequence)")
    lines += ["", "within tolerance" if c.ok else "NOT within tolerance"]
    return "\n".join(lines)
