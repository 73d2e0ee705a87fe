"""The trained heads of the semantic layer (heads.npz), an artifact of tools/semantic/train.py."""
