"""scalenlp: transformer NLP models from one CPU to a cluster."""

__version__ = "0.1.0"
