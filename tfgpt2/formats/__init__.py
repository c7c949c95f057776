"""Files in and out: OpenAI's checkpoint folders (`checkpoint`, read through `bundle`), the
Hugging Face and KerasHub layouts (`convert`), the SavedModel (`saved_model`), downloads
(`download`), and the one way every file is written (`files`)."""
