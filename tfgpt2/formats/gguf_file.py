"""GPT-2 as one GGUF file, the format of llama.cpp and the tools built on it (`gguf`, the
llama.cpp project's package, writes it).

The file holds what llama.cpp's own converter (`convert_hf_to_gguf.py`) writes for Hugging
Face's GPT-2: architecture `gpt2`, its hyperparameters, the tokenizer (`gpt2` byte-level BPE
with the `gpt-2` pre-tokenizer: every token, its type, every merge, <|endoftext|> as beginning
and end of text, never added to a prompt), and the tensors under llama.cpp's names, each
Conv1D weight [1, nx, nf] stored as [nf, nx] (llama.cpp's [out, in]). With `outtype`:

- `f32`: every tensor as the checkpoint has it;
- `f16`: the matrices in float16, the biases, norms and position embedding in float32;
- `q8_0`: the matrices in llama.cpp's Q8_0 (blocks of 32 int8 values with a float16 scale:
  its abs max / 127), the rest as `f16`'s; a matrix whose rows are no multiple of 32 long
  stays float16, as llama.cpp's converter does.

    tfgpt2 convert --from openai --to gguf models/124M exports/gpt2-124M-q8_0.gguf --outtype q8_0

The file is written under a temporary name beside it and renamed when complete (`files`).
"""
import os

import numpy as np

from ..encoder import ASSETS_DIR, EOT, VOCAB_FILES, load_vocabulary, vocabulary_files
from .files import replacing
from .hf_kerashub import LAYOUT_VOCAB_FILES, check_tensors, read

OUTTYPES = ("f32", "f16", "q8_0")
ARCH = "gpt2"
# Each block's tensors: (checkpoint name under model/h<i>/, llama.cpp's name under blk.<i>.)
BLOCK = (("ln_1/g", "attn_norm.weight"), ("ln_1/b", "attn_norm.bias"),
         ("attn/c_attn/w", "attn_qkv.weight"), ("attn/c_attn/b", "attn_qkv.bias"),
         ("attn/c_proj/w", "attn_output.weight"), ("attn/c_proj/b", "attn_output.bias"),
         ("ln_2/g", "ffn_norm.weight"), ("ln_2/b", "ffn_norm.bias"),
         ("mlp/c_fc/w", "ffn_up.weight"), ("mlp/c_fc/b", "ffn_up.bias"),
         ("mlp/c_proj/w", "ffn_down.weight"), ("mlp/c_proj/b", "ffn_down.bias"))


def export_gguf(src, path, *, src_format="openai", outtype="f16"):
    """Write the model folder `src` (in layout `src_format`: `hf_kerashub.FORMATS`; an OpenAI
    folder may be a training run's, its latest `model-<step>`) to `path` as a GGUF file, with
    its vocabulary (the shipped copy where it has none)."""
    hparams, tensors = read(src, src_format)
    vocab = vocabulary_files(src, LAYOUT_VOCAB_FILES[src_format]) or \
        [os.path.join(ASSETS_DIR, file) for file in VOCAB_FILES]
    return write_gguf(hparams, tensors, path, outtype=outtype, vocab=vocab, name=default_name(src))


def gguf_names(hparams, *, tie_embeddings=True):
    """Checkpoint name -> llama.cpp's tensor name, for every variable of `GPT2(hparams)`."""
    names = {"model/wte": "token_embd.weight", "model/wpe": "position_embd.weight",
             "model/ln_f/g": "output_norm.weight", "model/ln_f/b": "output_norm.bias"}
    for layer in range(hparams.n_layer):
        names.update({f"model/h{layer}/{ours}": f"blk.{layer}.{theirs}" for ours, theirs in BLOCK})
    if not tie_embeddings:
        names["model/out_head"] = "output.weight"
    return names


def gguf_array(value):
    """A checkpoint tensor as llama.cpp stores it: a Conv1D weight [1, nx, nf] as [nf, nx]."""
    value = np.asarray(value, np.float32)
    return np.ascontiguousarray(value[0].T if value.ndim == 3 else value)


def tensor_type(name, array, outtype):
    """The GGML type `name` is stored in: the biases, norms and position embedding in F32;
    the other matrices in `outtype`'s, Q8_0 only where rows are whole blocks of 32 (F16 else)."""
    from gguf import GGMLQuantizationType as T
    if outtype == "f32" or array.ndim < 2 or name == "position_embd.weight":
        return T.F32
    if outtype == "q8_0" and array.shape[-1] % 32 == 0:
        return T.Q8_0
    return T.F16


def write_gguf(hparams, tensors, path, *, outtype="f16", vocab, name="gpt2"):
    """Write `tensors` (checkpoint name -> float32 array, as `hf_kerashub.read` gives them) to
    `path` as a GGUF file of `outtype` (`OUTTYPES`), with the tokenizer of `vocab`
    ((encoder.json, vocab.bpe) paths). Returns `path`."""
    import gguf
    if outtype not in OUTTYPES:
        raise ValueError(f"unknown GGUF type {outtype!r}; expected one of {list(OUTTYPES)}")
    check_tensors(hparams, tensors)
    names = gguf_names(hparams, tie_embeddings="model/out_head" not in tensors)
    with replacing(path) as tmp:
        writer = gguf.GGUFWriter(tmp, ARCH)
        add_hparams(writer, hparams, outtype, name)
        add_tokenizer(writer, load_vocabulary(vocab), hparams.n_vocab, vocab[0])
        for ours, theirs in names.items():
            array = gguf_array(tensors[ours])
            kind = tensor_type(theirs, array, outtype)
            stored = gguf.quants.quantize(array, kind) if kind == gguf.GGMLQuantizationType.Q8_0 else \
                array.astype(np.float16 if kind == gguf.GGMLQuantizationType.F16 else np.float32)
            writer.add_tensor(theirs, stored, raw_dtype=kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return path


def add_hparams(writer, hparams, outtype, name):
    """The general and `gpt2.*` keys, as llama.cpp's converter writes them for GPT-2."""
    from gguf import GGML_QUANT_VERSION, LlamaFileType
    writer.add_name(name)
    writer.add_context_length(hparams.n_ctx)
    writer.add_embedding_length(hparams.n_embd)
    writer.add_feed_forward_length(4 * hparams.n_embd)
    writer.add_block_count(hparams.n_layer)
    writer.add_head_count(hparams.n_head)
    writer.add_layer_norm_eps(1e-5)
    writer.add_file_type({"f32": LlamaFileType.ALL_F32, "f16": LlamaFileType.MOSTLY_F16,
                          "q8_0": LlamaFileType.MOSTLY_Q8_0}[outtype])
    writer.add_quantization_version(GGML_QUANT_VERSION)


def add_tokenizer(writer, encoder, n_vocab, where):
    """GPT-2's byte-level BPE as llama.cpp reads it: the tokens in id order (n_vocab of them:
    a larger model's extra rows as unused [PAD<i>] tokens), their types (<|endoftext|> a
    control token), the merges in rank order, and <|endoftext|> as BOS and EOS, not added."""
    from gguf import TokenType
    if encoder.n_vocab > n_vocab:
        raise ValueError(f"{where}: the vocabulary has {encoder.n_vocab} tokens, more than the model's "
                         f"n_vocab {n_vocab}: llama.cpp needs a token for each row of the embedding")
    tokens = [encoder.decoder[i] for i in range(encoder.n_vocab)]
    types = [TokenType.CONTROL if token == EOT else TokenType.NORMAL for token in tokens]
    tokens += [f"[PAD{i}]" for i in range(encoder.n_vocab, n_vocab)]
    types += [TokenType.UNUSED] * (n_vocab - encoder.n_vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([" ".join(pair) for pair in sorted(encoder.bpe_ranks, key=encoder.bpe_ranks.get)])
    writer.add_bos_token_id(encoder.eot_token)
    writer.add_eos_token_id(encoder.eot_token)
    writer.add_add_bos_token(False)


def default_name(path):
    """The model's name in the file: its folder's (models/124M -> 124M)."""
    return os.path.basename(os.path.normpath(path)) or "gpt2"
