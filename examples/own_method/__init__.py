"""An example project that brings its own compression method to fedgc (see README.md)."""
