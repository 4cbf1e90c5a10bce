"""Flavor tables as plain data (no torch), so the pre-launch check can read a model's shape."""
