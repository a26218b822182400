"""Helpers nobody outside raydeck should import."""
