"""How weights come in and go out: Hugging Face safetensors, GGUF, the hub cache, the packaged
SmolLM2, LoRA merges on export, and the weights loader (`loading.py`) that `opener` and
`train.state` call to turn a `model` config section into a policy and its tokenizer."""
