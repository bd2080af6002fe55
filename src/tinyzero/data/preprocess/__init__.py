"""tinyzero.data.preprocess."""
