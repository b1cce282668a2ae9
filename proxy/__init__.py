"""olp proxy layer."""
