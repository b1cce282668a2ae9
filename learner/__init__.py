"""olp learner layer."""
