"""Fine-tuning: the loop (`loop.train`, which reads like nanoGPT's train.py), the compiled step
(`step`), the optimizers, the run folder, the data, `tf.distribute`, and the loss over a text
(`perplexity`). `config.TrainConfig` is a run's settings, the command's flags; `loop.finetune`
takes them as keywords."""
