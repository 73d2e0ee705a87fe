"""The semantic layer in front of the KV-aware router (issue 8): jailbreak and PII guards, a shared
semantic cache, category classification, model selection for "MoM"/"auto" and per-category system
prompts. `farm.semantic.layer.SemanticLayer` is the one entry point; nothing here imports torch until
the layer is built, so `farm.config` can import `farm.config.semantic` cheaply."""
