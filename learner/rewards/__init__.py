"""Rewards: explicit feedback, verifiers, the generative judge, and their assembler."""
