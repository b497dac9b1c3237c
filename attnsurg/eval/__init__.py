"""Measuring models: perplexity on shared token windows, and costs (KV cache, parameters, speed)."""
