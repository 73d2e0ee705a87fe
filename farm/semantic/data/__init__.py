"""Data sets of the semantic layer (sources here, generated *.jsonl beside them) and the trained heads."""
