"""The pipeline driver: stages in order, frozen hand-off through the object store, durable artifacts."""
