"""The run loop: a batch of requests through the stages, claims and manifest, memory, timing."""
