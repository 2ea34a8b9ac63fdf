"""The fedgc client: the Flower ClientApp (``client.app:app``), local training and state store."""
