"""planners/poet."""
