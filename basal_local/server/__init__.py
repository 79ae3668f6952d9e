"""The HTTP daemon: a thin litestar shell around the engines."""
