"""Adapters that put attnkit behind other libraries' attention hooks (docs/integrations.md).

Each module imports its library; import the one you use (``attnkit.integrations.transformers``).
"""
