"""Reusable dashboard widgets; each keeps its own DEFAULT_CSS."""
