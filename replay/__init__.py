"""olp replay layer."""
