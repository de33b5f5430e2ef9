"""Model definitions (pure functions over parameter pytrees)."""
