"""Lineage: what happens to a trained run afterwards. A run continued from another's weights
(retrain.py), scored on held-out prompts (evaluate.py), promoted to a lineage's serving pointer
(promote.py), or exported as a plain Hugging Face model folder (export.py).
"""
