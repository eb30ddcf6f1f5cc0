"""Launch stage: engine processes in their own process groups, torn down on every exit path."""
