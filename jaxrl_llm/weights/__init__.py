"""How weights come in and go out: Hugging Face safetensors, GGUF, the hub cache, the packaged
SmolLM2, LoRA merges on export, and the one loader that reads a `model` config section."""
