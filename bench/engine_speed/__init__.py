"""bench/engine_speed: the farm's serving path against `vllm serve` with a nearly free engine (a tiny random
Llama with SmolLM2's tokenizer). See bench/engine_speed/run.py for the command and what is measured."""
