"""Benchmark evaluation of decoders: multiple-choice tasks scored by log-likelihood (``multiple_choice``) and a
model backend for EleutherAI's lm-evaluation-harness (``lm_eval``), both through the inference engine."""
