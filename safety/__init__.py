"""olp safety layer."""
