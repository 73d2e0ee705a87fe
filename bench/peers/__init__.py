"""bench/peers: the farm side by side with vLLM alone, vLLM's router and NVIDIA Dynamo (issue 20, item 5).

See bench/peers/run.py for the command and what is measured."""
