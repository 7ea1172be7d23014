"""Harnesses for scalenlp's tests and benchmarks; scalenlp itself never imports them."""
