"""vision_tower: filled in by later issues."""
