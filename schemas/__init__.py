"""Pydantic models that parameterize a tracefp4 run, and their JSON Schema."""
