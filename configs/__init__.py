"""Presets: Python functions returning the root config."""
