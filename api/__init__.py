"""The farm's HTTP API: OpenAI-compatible routes on a Flask application factory."""
