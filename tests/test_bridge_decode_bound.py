"""The phone bridge decodes an upload with the model's size as its bound (issue 14, item 3)."""

from __future__ import annotations

import hashlib

import torch

from android_bridge.bridge import SESSION_METADATA_KEY
from android_bridge.proto import fedgc_bridge_pb2 as pb
from android_bridge.proto import fedgc_bridge_pb2_grpc as pb_grpc
from dgc import SparseTensor, SparseUpdate, encode
from tests.test_bridge import TOKENS, _channel, _task, bridge, certs  # noqa: F401 - fixtures


def test_an_upload_claiming_a_tensor_larger_than_the_model_is_rejected(bridge, certs):  # noqa: F811
    stub = pb_grpc.FedgcBridgeStub(_channel(bridge, certs))
    session = stub.Register(pb.RegisterRequest(device_id="phone-a",
                                               token=TOKENS["phone-a"])).session_id
    task, state = _task("phone-a")
    bridge.submit(task)
    largest = max(t.numel() for t in state.values())
    # A valid update with the task's sequence, whose one tensor claims one entry more than the
    # model's largest: a receiver that densifies it would allocate beyond the model.
    data = encode(SparseUpdate({"w": SparseTensor(torch.tensor([0]), torch.tensor([1.0]),
                                                  (largest + 1,))}, task.sequence))
    chunk = pb.UploadChunk(session_id=session, task_id=task.task_id, upload_id="big", offset=0,
                           data=data, total_bytes=len(data),
                           sha256=hashlib.sha256(data).hexdigest(),
                           metrics_json='{"num-examples": 60}')
    assert stub.UploadUpdate(iter([chunk]),
                             metadata=((SESSION_METADATA_KEY, session),)).complete
    ack = stub.Ack(pb.AckRequest(session_id=session, upload_id="big"))
    assert ack.state == pb.REJECTED, ack
    assert f"above max_numel={largest}" in ack.detail, ack.detail
