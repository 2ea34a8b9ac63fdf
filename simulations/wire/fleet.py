"""Flower's Fleet API on the wire (protobuf over HTTP/1.1): each RPC's bytes, split by owner.

A SuperNode pulls a message in pieces: ``PullMessages`` returns its metadata and object tree,
``PullObject`` fetches each object (the message, its RecordDict, each record, each Array and the
ArrayChunks that hold the data), ``ConfirmMessageReceived`` ends it. A reply goes up the same
way (``PushMessages``, then ``PushObject`` per object the SuperLink lacks). Between messages
the node polls (``PullMessages`` with nothing to pull, every 3 s) and sends a heartbeat every
30 s.

An object is ``"<Type> <child ids> <body length>\\0<body>"`` (``flwr.supercore.inflatable``).
What fedgc chose to send is split from how Flower ships it:

- an ``ArrayChunk``'s body is **payload** (the update's or model's bytes);
- a ``ConfigRecord``'s or ``MetricRecord``'s body is **fedgc** (its keys and values);
- an ``Array``'s dtype, shape and stype values, and the record names of a ``RecordDict`` or
  ``ArrayRecord``, are **fedgc**; the rest of their JSON bodies (keys, chunk indices, child ids)
  is **flower**;
- every object head, a ``Message`` object, and every protobuf field outside the object content
  (node, run id, object id, session id, trees, metadata) is **flower**, as are the RPCs that
  carry no message (polls, heartbeats, registration, run and app-bundle fetches) and the
  ``flwr-*`` head lines of every request (versions, the node's public key, a timestamp and an
  ECDSA signature: Flower's node authentication, sent even by a self-registered node).
- the rest of the HTTP heads (request and status lines, host, content type and length,
  keep-alive, user agent, date, server) is **http**.
"""

from __future__ import annotations

import json

from flwr.proto import fab_pb2, fleet_pb2, heartbeat_pb2, message_pb2, run_pb2

from .http1 import HttpMessage
from .ledger import Exchange, empty
from .tcp import DOWN, UP

#: path -> (RPC name, request type, response type).
RPCS = {
    "/v1/fleet/register-node": ("RegisterNode", fleet_pb2.RegisterNodeFleetRequest,
                                fleet_pb2.RegisterNodeFleetResponse),
    "/v1/fleet/activate-node": ("ActivateNode", fleet_pb2.ActivateNodeRequest,
                                fleet_pb2.ActivateNodeResponse),
    "/v1/fleet/deactivate-node": ("DeactivateNode", fleet_pb2.DeactivateNodeRequest,
                                  fleet_pb2.DeactivateNodeResponse),
    "/v1/fleet/unregister-node": ("UnregisterNode", fleet_pb2.UnregisterNodeFleetRequest,
                                  fleet_pb2.UnregisterNodeFleetResponse),
    "/v1/fleet/send-node-heartbeat": ("SendNodeHeartbeat",
                                      heartbeat_pb2.SendNodeHeartbeatRequest,
                                      heartbeat_pb2.SendNodeHeartbeatResponse),
    "/v1/fleet/pull-messages": ("PullMessages", fleet_pb2.PullMessagesRequest,
                                fleet_pb2.PullMessagesResponse),
    "/v1/fleet/push-messages": ("PushMessages", fleet_pb2.PushMessagesRequest,
                                fleet_pb2.PushMessagesResponse),
    "/v1/fleet/get-run": ("GetRun", run_pb2.GetRunRequest, run_pb2.GetRunResponse),
    "/v1/fleet/get-fab": ("GetFab", fab_pb2.GetFabRequest, fab_pb2.GetFabResponse),
    "/v1/fleet/push-object": ("PushObject", message_pb2.PushObjectRequest,
                              message_pb2.PushObjectResponse),
    "/v1/fleet/pull-object": ("PullObject", message_pb2.PullObjectRequest,
                              message_pb2.PullObjectResponse),
    "/v1/fleet/confirm-message-received": ("ConfirmMessageReceived",
                                           message_pb2.ConfirmMessageReceivedRequest,
                                           message_pb2.ConfirmMessageReceivedResponse),
}
#: Head lines Flower adds to every request (package, component, node key, timestamp, signature).
FLOWER_HEADER_PREFIX = "flwr-"
SETUP_RPCS = ("RegisterNode", "ActivateNode", "DeactivateNode", "UnregisterNode", "GetRun",
              "GetFab")


def split_object(content: bytes) -> tuple[str, dict[str, int]]:
    """An object's type and its bytes as payload, fedgc and flower (they sum to its length)."""
    out = empty()
    head_end = content.find(b"\x00")
    if head_end < 0:
        out["flower"] = len(content)
        return "?", out
    obj_type = content[:head_end].split(b" ", 1)[0].decode("latin-1")
    body = content[head_end + 1:]
    out["flower"] = head_end + 1
    fedgc = 0
    if obj_type == "ArrayChunk":
        out["payload"] = len(body)
    elif obj_type in ("ConfigRecord", "MetricRecord"):
        fedgc = len(body)
    elif obj_type == "Array":
        try:
            meta = json.loads(body)
            fedgc = sum(len(json.dumps(meta[k])) for k in ("dtype", "shape", "stype"))
        except (ValueError, KeyError):
            fedgc = 0
    elif obj_type in ("ArrayRecord", "RecordDict"):
        try:
            fedgc = sum(len(json.dumps(k)) for k in json.loads(body))
        except ValueError:
            fedgc = 0
    out["fedgc"] = fedgc
    out["flower"] += len(body) - fedgc - out["payload"]
    return obj_type, out


#: A secure-aggregation stage's bytes begin with fedgc's magic ``FGA<n>``
#: (``fedgc/privacy/secagg/wire.py``): n -> the stage (request even, reply odd).
SECAGG_STAGES = {b"0": "setup", b"1": "setup", b"2": "share_keys", b"3": "share_keys",
                 b"4": "masked_vector", b"5": "masked_vector", b"6": "unmask", b"7": "unmask"}


def secagg_stage(chunk_body: bytes) -> str | None:
    """The secure-aggregation stage whose bytes an ArrayChunk begins, or None."""
    if chunk_body[:3] != b"FGA":
        return None
    return SECAGG_STAGES.get(chunk_body[3:4])


class FleetSession:
    """Follows one node's Fleet RPCs in time order: which message each object belongs to."""

    def __init__(self) -> None:
        self.object_message: dict[str, tuple[str, int | None]] = {}  # object id -> (type, round)
        self.messages: dict[str, tuple[str, int | None]] = {}  # message id -> (type, round)
        #: object id -> its message's object id (the root of the message's object tree)
        self.object_root: dict[str, str] = {}
        #: a message's object id -> the secure-aggregation stage its bytes carry
        self.stage_of: dict[str, str] = {}

    def _note_tree(self, tree: message_pb2.ObjectTree, x: Exchange) -> None:
        for object_id in self._tree_ids(tree):
            self.object_root[object_id] = tree.object_id
        x.detail["message"] = tree.object_id

    def stage(self, x: Exchange) -> str | None:
        """The secure-aggregation stage of an exchange's message (once the whole capture was
        classified: a message's stage shows in its chunks, fetched after its head)."""
        message = x.detail.get("message")
        return None if message is None else self.stage_of.get(str(message))

    def _tree_ids(self, tree: message_pb2.ObjectTree) -> list[str]:
        ids, todo = [], [tree]
        while todo:
            node = todo.pop()
            ids.append(node.object_id)
            todo.extend(node.children)
        return ids

    def classify(self, request: HttpMessage, response: HttpMessage | None,
                 conn: int) -> Exchange:
        """The exchange of one request and its response, its bytes per category filled in
        for payload, fedgc, flower and http (TLS and TCP/IP come from :mod:`.ledger`)."""
        span_down = (response.start, response.end) if response else (0, 0)
        spec = RPCS.get(request.path)
        rpc = spec[0] if spec else request.path or "?"
        x = Exchange(conn, rpc, "other", None, ((request.start, request.end), span_down))
        up, down = x.bytes[UP], x.bytes[DOWN]
        # Flower's own head lines (version, node key, timestamp, signature) are its protocol.
        for side, msg in ((up, request), (down, response)):
            if msg is not None:
                own = msg.header_bytes(FLOWER_HEADER_PREFIX)
                side["http"] += msg.http_bytes - own
                side["flower"] += own
        up["flower"] += len(request.body)
        if response is not None:
            down["flower"] += len(response.body)
        if spec is None or response is None:
            return x
        req = spec[1]()
        rsp = spec[2]()
        try:
            req.ParseFromString(request.body)
            if response.status == 200:
                rsp.ParseFromString(response.body)
        except Exception:  # noqa: BLE001 - a body that does not parse stays Flower's bytes
            return x
        if rpc in SETUP_RPCS:
            x.kind = "setup"
        elif rpc == "SendNodeHeartbeat":
            x.kind = "heartbeat"
        elif rpc == "PullMessages":
            if len(rsp.messages_list):
                meta = rsp.messages_list[0].metadata
                info = (meta.message_type, _round(meta.group_id))
                self.messages[meta.message_id] = info
                for tree in rsp.message_object_trees:
                    for object_id in self._tree_ids(tree):
                        self.object_message[object_id] = info
                    self._note_tree(tree, x)
                x.kind, x.round = f"{info[0]}-down", info[1]
                x.detail["message_id"] = meta.message_id
            else:
                x.kind = "poll"
        elif rpc == "PushMessages":
            meta = req.messages_list[0].metadata if len(req.messages_list) else None
            if meta is not None:
                info = self.messages.get(meta.reply_to_message_id,
                                         (meta.message_type, _round(meta.group_id)))
                for tree in req.message_object_trees:
                    for object_id in self._tree_ids(tree):
                        self.object_message[object_id] = info
                    self._note_tree(tree, x)
                x.kind, x.round = f"{info[0]}-up", info[1]
                x.detail["clientapp_runtime_s"] = (list(req.clientapp_runtime_list) or [0.0])[0]
        elif rpc in ("PullObject", "PushObject"):
            info = self.object_message.get(req.object_id, ("?", None))
            x.kind = f"{info[0]}-{'down' if rpc == 'PullObject' else 'up'}"
            x.round = info[1]
            content = rsp.object_content if rpc == "PullObject" else req.object_content
            obj_type, parts = split_object(bytes(content))
            x.detail["object_type"] = obj_type
            root = self.object_root.get(req.object_id)
            if root is not None:
                x.detail["message"] = root
                stage = (secagg_stage(bytes(content).split(b"\x00", 1)[-1])
                         if obj_type == "ArrayChunk" else None)
                if stage is not None:
                    self.stage_of[root] = stage
            side = down if rpc == "PullObject" else up
            for key in ("payload", "fedgc"):
                side[key] += parts[key]
                side["flower"] -= parts[key]
        elif rpc == "ConfirmMessageReceived":
            info = self.object_message.get(req.message_object_id, ("?", None))
            x.kind, x.round = f"{info[0]}-down", info[1]
            x.detail["message"] = req.message_object_id
        return x


def _round(group_id: str) -> int | None:
    return int(group_id) if group_id.isdigit() else None
