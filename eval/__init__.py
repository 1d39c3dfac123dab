"""eval: filled in by later issues."""
