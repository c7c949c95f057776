"""`tfgpt2 serve`: an OpenAI-compatible completions server with continuous batching inside the
compiled step. `protocol` reads requests (checked by decoding's generation rule) and writes
responses, `text` turns tokens into streamed text, `scheduler` runs sequences on the slots of
`decoding.slots`, and `app` is the HTTP server (FastAPI on uvicorn). docs/serving.md."""
