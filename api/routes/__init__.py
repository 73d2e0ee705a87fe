"""Blueprints of the API."""
