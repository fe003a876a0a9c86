"""Micro-benchmarks of structured (grammar-constrained) decoding."""
