"""Generation's machinery: the rules a request must meet (`request`), the model's layers over a
fixed-size key/value cache (`cache`), the block weights in layouts that XLA on a CPU multiplies
faster (`layouts`), the length buckets (`buckets`), the controls past temperature, top-k and top-p
(`controls`), the sampler (`sampler`) and the compiled loops (`generator`, and `slots` for the
server). Nothing here imports `tfgpt2.sample`, the library's door above it."""
