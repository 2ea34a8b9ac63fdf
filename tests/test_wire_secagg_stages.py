"""A capture's secure-aggregation stages (simulations/wire/fleet.py, report.py): each stage's
messages recognised by fedgc's magic in their chunks, every byte of their Fleet RPCs given to
the stage, and the stages sent as messages of their own summed as the emulator charges them."""

from __future__ import annotations

from flwr.proto import fleet_pb2, message_pb2

from fedgc.privacy.secagg import ClientHandler, ServerSession
from simulations.wire.fleet import FleetSession, secagg_stage
from simulations.wire.http1 import HttpMessage
from simulations.wire.report import secagg_stages


def _http(path: str, body: bytes, response: bool = False) -> HttpMessage:
    line = "HTTP/1.1 200 OK" if response else f"POST {path} HTTP/1.1"
    return HttpMessage(0, len(body) + 40, line, body=body)


def _pull(session: FleetSession, message_type: str, chunk: bytes, msg_id: str
          ) -> list:
    """A message pulled by a node: its head, its one chunk, the receipt (three RPCs)."""
    root, chunk_id = f"msg-{msg_id}", f"chunk-{msg_id}"
    head = fleet_pb2.PullMessagesResponse(
        messages_list=[message_pb2.Message(metadata=message_pb2.Metadata(
            message_id=msg_id, message_type=message_type, group_id="1"))],
        message_object_trees=[message_pb2.ObjectTree(object_id=root, children=[
            message_pb2.ObjectTree(object_id=chunk_id)])])
    content = b"ArrayChunk  %d\x00" % len(chunk) + chunk
    obj = message_pb2.PullObjectResponse(object_content=content)
    done = message_pb2.ConfirmMessageReceivedRequest(message_object_id=root)
    return [
        session.classify(_http("/v1/fleet/pull-messages",
                               fleet_pb2.PullMessagesRequest().SerializeToString()),
                         _http("", head.SerializeToString(), True), 0),
        session.classify(_http("/v1/fleet/pull-object", message_pb2.PullObjectRequest(
            object_id=chunk_id).SerializeToString()), _http("", obj.SerializeToString(), True), 0),
        session.classify(_http("/v1/fleet/confirm-message-received", done.SerializeToString()),
                         _http("", b"", True), 0),
    ]


def test_each_stage_message_is_attributed_by_the_magic_of_its_bytes() -> None:
    # Real stage bytes: a two-client session's setup request and a client's keys.
    server = ServerSession([0, 1], 4, 20)
    setup = server.setup()[0]
    keys = ClientHandler(0, 4).setup(setup)
    assert secagg_stage(setup) == "setup" and secagg_stage(keys) == "setup"
    assert secagg_stage(b"FGB0...") is None and secagg_stage(b"") is None
    session = FleetSession()
    staged = _pull(session, "query.secagg", setup, "a")
    plain = _pull(session, "train", b"\x00" * 64, "b")
    for x in staged + plain:  # as the capture's analysis does, once all are classified
        if (stage := session.stage(x)) is not None:
            x.detail["secagg_stage"] = stage
    assert [x.detail.get("secagg_stage") for x in staged] == ["setup"] * 3
    assert all("secagg_stage" not in x.detail for x in plain)
    out = secagg_stages([(0, x) for x in staged + plain])
    assert set(out) == {"setup", "exchange_bytes"} and out["setup"]["messages"] == 1
    wire = {d: sum(x.total(i) for x in staged) for i, d in enumerate(("up", "down"))}
    assert out["exchange_bytes"] == wire  # every byte of the three RPCs, none of the train's
    assert out["setup"]["bytes"]["down"]["payload"] == len(setup)
    assert secagg_stages([(0, x) for x in plain]) == {}
