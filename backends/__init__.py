"""Built-in backends, one subpackage each, installed as ``attnkit.backends``.

They use only attnkit's public API; importing a subpackage registers its backends.
"""
