"""The plait HTTP server."""
