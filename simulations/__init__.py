"""fedgc scenarios on Flower's simulation engine: ``python -m simulations run|compare|demo``."""
