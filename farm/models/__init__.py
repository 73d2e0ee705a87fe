"""Model files on this machine: where a model's directory is and preparing it (`directories`: the built-in GGUF
converted once), and its tokenizer (`tokenization`: chat templates, prompt ids, incremental detokenizing)."""
