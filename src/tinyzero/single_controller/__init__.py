"""tinyzero.single_controller."""
