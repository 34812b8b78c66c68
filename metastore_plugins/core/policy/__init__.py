"""Capture policies: what each layer keeps under the byte budget, and tags that adjust it."""
