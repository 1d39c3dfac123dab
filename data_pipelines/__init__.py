"""data_pipelines: filled in by later issues."""
