"""The project's own template-made data (issue 8), kept apart from the real sets: see datagen.py."""
