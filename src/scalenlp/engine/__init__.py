"""Inference engines: the decoder engine (continuous batching, sampling, packed linears), the encoder engine,
sharded execution over processes, and the Python `LLM` class."""
