"""basal-local: run Basal typed-decision models on your own machine."""

__version__ = "0.1.0"
