"""An example project that brings its own model and data to fedgc (see README.md)."""
