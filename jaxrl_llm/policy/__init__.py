"""A whole policy in and out: `opener` opens a model and its tokenizer from any path a user
gives (the config's `model:`, `smollm2`, a `.gguf`, an HF directory, a Hub id, a run /
checkpoint / step directory) — the one entry for every command and the API —, and `export`
writes a checkpoint back out as a Hugging Face directory (or GGUF, or a PEFT adapter).
Above `weights`, `models` and `train`; below `eval`, `api` and the flows.
"""
