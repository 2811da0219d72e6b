"""Which transport a transfer takes, as a pure function of where its two ends run
(`--transport auto`; a fixed `--transport` is used as given):

    same host     shm: in place into the receiver's cache (kv_transfer/in_place.py)
    other hosts   grpc

Only transports this build has are chosen. The GPU path (issue 16) adds cuda-ipc for one GPU
and nccl between GPUs; until they exist the table falls through to the ones above. A choice
of shm is checked when it is used: if the receiver's cache cannot be mapped here (a host name
shared by two machines or containers), the transfer goes over grpc."""

from __future__ import annotations

import socket
from dataclasses import dataclass

TRANSPORTS = ("grpc", "shm")


@dataclass(frozen=True)
class Placement:
    node: str  # host name
    gpu: str = ""  # a GPU's UUID; "" on CPU


def select(sender: Placement, receiver: Placement, available: tuple[str, ...] = TRANSPORTS) -> str:
    """The fastest transport in `available` between the two ends."""
    same_node = bool(sender.node) and sender.node == receiver.node
    order = []
    if same_node and sender.gpu and sender.gpu == receiver.gpu:
        order.append("cuda-ipc")
    if same_node:
        order += ["cuda-ipc"] if sender.gpu and receiver.gpu else ["shm"]
    if sender.gpu and receiver.gpu:
        order.append("nccl")
    order.append("grpc")
    return next(t for t in order if t in available or t == "grpc")


def here() -> Placement:
    """This process's placement (CPU: the host name alone)."""
    return Placement(socket.gethostname())
