"""The bottom layer: crash-safe local file writes and S3 access, used by the
checkpoint, state, source and sink packages alike."""
