"""One reference phone in a process of its own (run inside its link's namespace), logging the
size of every gRPC message it sends and receives.

``python -m simulations.wire.phone_process --export DIR --device ID --token T --target H:P
--task NAME --partition-id I --num-clients N --rounds R --calls OUT.json [--ca PEM]``

The phone (:class:`android_bridge.phone.ReferencePhone`) registers, serves ``R`` tasks, and
exits; ``OUT.json`` lists each RPC with its start and end (wall clock, as the capture's
timestamps), the protobuf size of each request and response message, and the payload among
them (model bytes down, update bytes up), for :mod:`simulations.wire.bridge_link`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc


class CallLog(grpc.UnaryUnaryClientInterceptor, grpc.StreamUnaryClientInterceptor):
    """Records every call's messages (``ByteSize``) and its payload bytes."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def _record(self, method: str, started: float, sent: list[int], payload_up: int,
                call: Any) -> Any:
        row: dict[str, Any] = {"method": method.rsplit("/", 1)[-1], "t_start": started,
                               "request_bytes": sent, "payload_up": payload_up,
                               "response_bytes": [], "payload_down": 0}
        try:
            response = call.result()
        except grpc.RpcError as err:
            row["error"] = str(err.code())
        else:
            row["response_bytes"] = [response.ByteSize()]
            if hasattr(response, "model_bytes"):
                # The model or patch, and the sign channel's index sets (the server counts
                # them in the client's downlink, as on the SuperNode path).
                row["payload_down"] = (len(response.model_bytes)
                                       + len(getattr(response, "shared_mask", b"")))
                row["has_task"] = bool(response.has_task)
                row["server_round"] = int(response.server_round)
        row["t_end"] = time.time()
        self.calls.append(row)
        return call

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any,
                              request: Any) -> Any:
        started = time.time()
        return self._record(details.method, started, [request.ByteSize()], 0,
                            continuation(details, request))

    def intercept_stream_unary(self, continuation: Callable[..., Any], details: Any,
                               request_iterator: Iterator[Any]) -> Any:
        started = time.time()
        sizes: list[int] = []
        payload = [0]

        def counted() -> Iterator[Any]:
            for chunk in request_iterator:
                sizes.append(chunk.ByteSize())
                payload[0] += len(chunk.data)
                yield chunk

        call = continuation(details, counted())
        try:
            call.result()
        except grpc.RpcError:
            pass
        return self._record(details.method, started, sizes, payload[0], call)


def main(argv: Sequence[str]) -> int:
    """Run the phone for ``--rounds`` tasks and write its call log."""
    p = argparse.ArgumentParser(prog="python -m simulations.wire.phone_process")
    p.add_argument("--export", required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--token", required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--ca", default=None)
    p.add_argument("--task", required=True)
    p.add_argument("--partition-id", type=int, required=True)
    p.add_argument("--num-clients", type=int, required=True)
    p.add_argument("--partition", default="iid")
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--calls", required=True)
    p.add_argument("--task-timeout-s", type=float, default=600.0)
    args = p.parse_args(list(argv))

    # Imported here: start-up; a bad option is answered before torch loads.
    import torch

    from android_bridge.phone import ReferencePhone
    from android_bridge.proto import fedgc_bridge_pb2_grpc as pb_grpc
    from tasks import get_task

    torch.set_num_threads(1)
    task = get_task(args.task)
    part = task.partition(args.num_clients, scheme=args.partition, alpha=args.alpha,
                          seed=args.seed)[args.partition_id]
    ca = Path(args.ca).read_bytes() if args.ca else None
    phone = ReferencePhone(args.export, args.device, args.token, args.target,
                           task.train_x[part].numpy(), task.train_y[part].numpy(),
                           root_certificates=ca)
    log = CallLog()
    phone.channel = grpc.intercept_channel(phone.channel, log)
    phone.stub = pb_grpc.FedgcBridgeStub(phone.channel)
    rounds = []
    try:
        phone.register()
        for _ in range(args.rounds):
            report = phone.run_round(phone.wait_for_task(args.task_timeout_s))
            rounds.append({"round": report.server_round, "uplink_bytes": report.uplink_bytes,
                           "ack_state": report.ack_state})
    finally:
        phone.close()
        Path(args.calls).write_text(json.dumps({"calls": log.calls, "rounds": rounds}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
