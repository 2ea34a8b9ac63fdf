"""Probe ServerApp: Flower's FedAvg on a zero vector; prints the final weights as JSON."""

import json

import numpy as np
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run FedAvg for ``num-server-rounds`` rounds over at least ``min-nodes`` nodes."""
    rounds = int(context.run_config["num-server-rounds"])
    min_nodes = int(context.run_config["min-nodes"])
    size = int(context.run_config["payload-floats"])
    strategy = FedAvg(
        fraction_evaluate=0.0, min_train_nodes=min_nodes, min_available_nodes=min_nodes
    )
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord([np.zeros(size, dtype=np.float32)]),
        num_rounds=rounds,
    )
    final = result.arrays.to_numpy_ndarrays()[0]
    print("PROBE_RESULT " + json.dumps({"first": float(final[0]), "size": int(final.size)}))
