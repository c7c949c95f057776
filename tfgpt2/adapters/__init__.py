"""What `model.py`'s layers take on beside the original's math, one small adapter each, as
mixins its classes inherit, so that the layers read as the original's:

- `layer`: what a layer needs to be a Keras layer (its config, building its sublayers);
- `lora`: LoRA adapters on Conv1D (Keras' `Dense.enable_lora`) and on GPT2 (KerasHub's);
- `int8`: int8 weights on Conv1D (Keras' `quantize("int8")`) and a quantized model's config;
- `remat`: a block recomputed in the backward pass (Keras' rematerialization hook);
- `tf32`: whether the products may run in TensorFloat-32 (`products.matmul`);
- `unwritten`: variables left unwritten, for a checkpoint to be loaded into;
- `fit`: what Keras' `fit` and `evaluate` hand a loss (the logits).

Keras' layer API for these is partly private (`_tracker`, `_int8_call`, `_remat_mode`,
`_flatten_layers`): it is used here only.
"""
from .fit import Fit
from .int8 import Int8, Int8Model
from .layer import Config, Layer
from .lora import LoRA, LoRAModel
from .remat import Remat
from .tf32 import TF32
from .unwritten import Unwritten

__all__ = ["Config", "Fit", "Int8", "Int8Model", "Layer", "LoRA", "LoRAModel", "Remat", "TF32", "Unwritten"]
