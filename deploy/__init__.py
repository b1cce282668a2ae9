"""olp deploy layer."""
