"""Bundled data: tokenizer corpus for test models, sample requests, default config."""
