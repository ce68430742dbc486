"""The model client: one call to any model through litellm, in the decoding form its server accepts."""
