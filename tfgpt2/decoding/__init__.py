"""Generation's machinery: the model's layers over a fixed-size key/value cache (`cache`), the
block weights in layouts that XLA on a CPU multiplies faster (`layouts`), the request checks and
length buckets (`plan`), and the compiled loop (`loop`). The public API is `tfgpt2.sample`."""
