"""A numpy FedAvg probe app for fedgc's deployment tests."""
