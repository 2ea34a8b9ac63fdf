"""Probe ClientApp: returns the received weights plus (1 + partition-id), weighted by 1 example."""

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Add ``1 + partition-id`` to every weight so the FedAvg result is predictable."""
    arrays = msg.content["arrays"].to_numpy_ndarrays()
    offset = 1.0 + float(context.node_config.get("partition-id", 0))
    content = RecordDict(
        {
            "arrays": ArrayRecord([a + offset for a in arrays]),
            "metrics": MetricRecord({"num-examples": 1, "offset": offset}),
        }
    )
    return Message(content=content, reply_to=msg)
