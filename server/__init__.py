"""The fedgc server: DGCStrategy (a Flower FedAvg) and the ServerApp (``server.app:app``)."""

from server.strategy import DGCStrategy

__all__ = ["DGCStrategy"]
