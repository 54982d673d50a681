"""Running one engine over `tp_size` ranks of torch.distributed (gloo on CPUs, NCCL on GPUs).

Rank 0 is the whole engine: tokenizer, scheduler, radix cache, sampling. Its model is wrapped in
a `StepBroadcaster` that, before every forward pass, sends the step's inputs (token ids,
positions, attention layout, layer count) to the other ranks; each of those runs the same pass
over its shard of the weights and of the KV pool (sharded by head, same page numbering), and the
row-parallel layers' all-reduces keep every rank in lock step. Only rank 0 computes logits.

Ranks start either here (`start_tensor_parallel` spawns ranks 1..N-1 on the same host) or under
`torchrun` (each rank is its own process; ranks other than 0 call `run_worker`).

    torchrun --nproc-per-node 2 -m plait.server.cli --tp 2      # one machine, two ranks
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import os
import pickle
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait.kernels.kv_cache import resolve_kv_dtype
from plait.kernels.layer_ops import LayerOps, choose_layer_ops
from plait.runtime.forward_batch import ForwardBatch
from plait.runtime.kv_pool import KVPool
from plait.runtime.models.tensor_parallel import check_shardable, shard_llama

_TIMEOUT = datetime.timedelta(minutes=30)


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet: a TCP store on rank 0's host.

    ``agent_store`` means torchrun's agent already serves the store on ``port``, so every
    rank joins it as a client (rank 0 hosts the store otherwise).
    """

    host: str
    port: int
    world_size: int
    agent_store: bool = False

    @classmethod
    def from_torchrun(cls) -> Rendezvous | None:
        """The torchrun environment (MASTER_ADDR, MASTER_PORT, WORLD_SIZE), if this is one."""
        env = os.environ
        if "TORCHELASTIC_RUN_ID" not in env and "LOCAL_RANK" not in env:
            return None
        agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        return cls(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), agent_store)

    def connect(self, rank: int, device: torch.device) -> Any:
        import torch.distributed as dist

        host_store = rank == 0 and not self.agent_store
        store = dist.TCPStore(self.host, self.port, self.world_size, host_store, timeout=_TIMEOUT)
        store = dist.PrefixStore(
            "plait/", store
        )  # torchrun's agent keeps its own keys in the same store
        if device.type == "cuda":
            return dist.ProcessGroupNCCL(store, rank, self.world_size)
        return dist.ProcessGroupGloo(store, rank, self.world_size, _TIMEOUT)


def torchrun_rank() -> int | None:
    value = os.environ.get("RANK")
    return int(value) if value is not None and Rendezvous.from_torchrun() is not None else None


class Channel:
    """Pickled Python objects from rank 0 to every rank, over the group's broadcast."""

    def __init__(self, group: Any, device: torch.device) -> None:
        self.group = group
        self.device = device  # NCCL moves only device tensors

    def send(self, obj: Any) -> None:
        data = torch.frombuffer(
            bytearray(pickle.dumps(_to(obj, torch.device("cpu")))), dtype=torch.uint8
        )
        self._broadcast(torch.tensor([data.numel()], dtype=torch.long))
        self._broadcast(data)

    def receive(self) -> Any:
        size = torch.zeros(1, dtype=torch.long)
        self._broadcast(size)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        self._broadcast(data)
        return _to(pickle.loads(data.numpy().tobytes()), self.device)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        moved = tensor.to(self.device)
        self.group.broadcast(moved, 0).wait()
        if moved is not tensor:
            tensor.copy_(moved.cpu())


class StepBroadcaster(nn.Module):
    """Rank 0's model: announces each forward pass to the other ranks, then runs its own shard."""

    def __init__(self, model: nn.Module, channel: Channel) -> None:
        super().__init__()
        self.inner = model
        self.args = model.args
        self.channel = channel

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        self.channel.send(
            ("forward", input_ids, positions, batch.attn, batch.attn_window, num_layers)
        )
        return self.inner(input_ids, positions, batch, num_layers)

    def stop_workers(self) -> None:
        self.channel.send(("stop",))


@dataclass
class TensorParallel:
    """Rank 0's handle: the wrapped model, its rank's args, and the worker processes."""

    model: StepBroadcaster
    args: Any
    processes: list[Any]

    def start_workers(self, num_pages: int, page_size: int, num_window_pages: int = 0) -> None:
        """Tells every rank how large a KV pool to allocate (rank 0 decides)."""
        self.model.channel.send(("pool", num_pages, page_size, num_window_pages))

    def shutdown(self) -> None:
        self.model.stop_workers()
        for p in self.processes:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def start_tensor_parallel(model: nn.Module, config: Any, device: torch.device) -> TensorParallel:
    """Rank 0's side: spawn ranks 1..N-1 (unless torchrun started them), join the group, shard."""
    tp_size = config.tp_size
    check_shardable(model.args, tp_size)  # before any rank starts waiting for the others
    rendezvous = Rendezvous.from_torchrun()
    processes: list[Any] = []
    if rendezvous is None:
        rendezvous = Rendezvous("127.0.0.1", _free_port(), tp_size)
        for rank in range(1, tp_size):
            # NOTE: a fresh interpreter, not multiprocessing's spawn, which would re-run the
            # caller's unguarded script.
            spec = base64.b64encode(pickle.dumps((rank, rendezvous, config))).decode()
            cmd = [sys.executable, "-m", "plait.runtime.tensor_parallel", spec]
            processes.append(subprocess.Popen(cmd))
    elif rendezvous.world_size != tp_size:
        raise ValueError(f"tp_size: {tp_size}, but torchrun started {rendezvous.world_size} ranks")
    try:
        group = rendezvous.connect(0, device)
        args = shard_llama(model, 0, tp_size, group)
    except BaseException:
        for p in processes:
            p.kill()
        raise
    return TensorParallel(StepBroadcaster(model, Channel(group, device)), args, processes)


def run_worker(rank: int, rendezvous: Rendezvous | None, config: Any) -> None:
    """Ranks 1..N-1: load and shard the model, then run every forward pass rank 0 announces."""
    from plait.runtime.engine import resolve_device, resolve_dtype
    from plait.runtime.engine_setup import window_layers
    from plait.runtime.execution import choose_attention
    from plait.runtime.model_loader import load_model

    rendezvous = rendezvous or Rendezvous.from_torchrun()
    assert rendezvous is not None
    mc = config.model
    device = resolve_device(mc.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(config.cpu_threads or max(1, (os.cpu_count() or 1) // config.tp_size))
    dtype = resolve_dtype(mc.dtype, device)
    model = load_model(mc.model_path, dtype, device, mc.quantization or "float32").model
    group = rendezvous.connect(rank, device)
    args = shard_llama(model, rank, config.tp_size, group)
    channel = Channel(group, device)
    pool: KVPool | None = None
    ops: LayerOps | None = None
    with torch.inference_mode():
        while True:
            message = channel.receive()
            if message[0] == "stop":
                return
            if message[0] == "pool":
                _, num_pages, page_size, num_window_pages = message
                kv_dtype = resolve_kv_dtype(
                    config.cache.kv_cache_dtype,
                    dtype,
                    device,
                    config.model.quantization not in (None, "float32"),
                )
                windowed = window_layers(args) if num_window_pages else ()
                pool = KVPool(
                    num_pages,
                    page_size,
                    args.num_layers,
                    args.num_kv_heads,
                    args.head_dim,
                    kv_dtype,
                    device,
                    windowed,
                    num_window_pages,
                )
                probe = torch.empty(0, dtype=dtype, device=device)
                ops = choose_layer_ops(device, dtype, choose_attention(probe, pool), pool.head_dim)
                continue
            _, input_ids, positions, attn, attn_window, num_layers = message
            assert pool is not None, "rank 0 sends the pool size before the first step"
            batch = ForwardBatch(
                kv_pool=pool, attn=attn, logits_indices=None, ops=ops, attn_window=attn_window
            )
            model.model(input_ids, positions, batch, num_layers)  # logits are rank 0's alone


def _to(obj: Any, device: torch.device) -> Any:
    """`obj` with every tensor inside (lists, tuples, dataclasses) moved to `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_to(x, device) for x in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: _to(getattr(obj, f.name), device) for f in dataclasses.fields(obj)}
        return dataclasses.replace(obj, **changes)
    return obj


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":  # a rank `start_tensor_parallel` spawned
    run_worker(*pickle.loads(base64.b64decode(sys.argv[1])))
