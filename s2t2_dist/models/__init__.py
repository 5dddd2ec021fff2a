"""HF model loading, tiny models from real configs, the llama2.c converter and the translated-LM wrapper."""
