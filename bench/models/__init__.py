"""The suite's built-in models: small language models whose answers depend on attention (bench/models/mqar.py)."""
