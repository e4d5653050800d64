"""Tensor parallelism's worker processes: ranks 1..N-1, spawned by rank 0 (the engine's own
process), one per GPU.

Rank 0 schedules, builds each step's inputs once on the host (a HostStep) and sends them down a
pipe to every worker; then every rank uploads the same inputs and runs the same forward on its
shard, the ranks meeting in the layers' all-reduces. Only rank 0 samples (every rank computes
the gathered logits; the workers drop theirs). A worker's model runner is built by the same
code as rank 0's, so the collectives of start-up (memory profiling, graph capture) pair up:
the engine hands TPWorkers the function that builds it (this package knows no engine).

Lifetime: a worker exits when rank 0 says so, when its pipe closes, and when rank 0's process
dies (the kernel's parent-death signal), so no exit of rank 0 leaves orphans. It ignores
Ctrl-C: the terminal's SIGINT reaches the whole process group, and rank 0 decides. A worker that
dies is seen by a watcher thread in rank 0, which records why and aborts the process group, so
that a collective waiting for the dead rank fails instead of hanging.
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import logging
import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm import tqdm

from nanoserve.distributed.parallel_state import abort_tp, destroy_tp, init_tp

log = logging.getLogger("nanoserve")

STOP = b""  # the message that ends a worker
PR_SET_PDEATHSIG = 1


class TensorParallelFailure(RuntimeError):
    """A rank of the tensor-parallel group is gone: no step can run any more."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device: torch.device, rank: int) -> torch.device:
    return device if device.type == "cpu" else torch.device("cuda", rank)


class StepExecutor(Protocol):
    """What a worker runs each step it receives with: the engine's model runner."""

    def execute(self, step: Any) -> None: ...


# (cfg, model_dir, max_model_len, device) -> the worker's runner, built after it joined the
# group; a module-level function, so that the spawned worker can unpickle it
BuildRunner = Callable[[Any, Path, int, torch.device], StepExecutor]


class TPWorkers:
    """Ranks 1..size-1 of the group, seen from rank 0."""

    def __init__(self, cfg, model_dir: Path, max_model_len: int,
                 build_runner: BuildRunner) -> None:
        size = cfg.tensor_parallel_size
        self.init_method = f"tcp://127.0.0.1:{free_port()}"
        self.failure: str | None = None
        self._closing = False
        ctx = mp.get_context("spawn")
        self.procs: list[mp.Process] = []
        self.conns: list[Connection] = []
        # no NVLink multicast, in NCCL or in symmetric memory (it can take a shared host's
        # GPUs down), unless the user asks for it
        env = {"NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0"),
               "TORCH_SYMM_MEM_DISABLE_MULTICAST":
                   os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")}
        os.environ.update(env)  # rank 0's own communicator, and the children's (inherited)
        for rank in range(1, size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, name=f"nanoserve-tp{rank}", daemon=True,
                            args=(rank, size, self.init_method, cfg, model_dir, max_model_len,
                                  build_runner, child, os.getpid()))
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        self._watcher = threading.Thread(target=self._watch, name="nanoserve-tp-watch",
                                         daemon=True)
        self._watcher.start()

    def wait_ready(self) -> None:
        """Returns once every worker has built its model runner; raises TensorParallelFailure
        with the worker's own error otherwise."""
        for rank, conn in enumerate(self.conns, 1):
            try:
                status, detail = conn.recv()
            except (EOFError, OSError):
                status, detail = "error", self.failure or "it exited during start-up"
            if status != "ready":
                raise TensorParallelFailure(f"tensor-parallel rank {rank} failed to start: "
                                            f"{detail}")

    def send(self, step) -> None:
        """The step's host inputs to every worker."""
        self.check()
        data = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self.conns:
                conn.send_bytes(data)
        except OSError as e:
            raise TensorParallelFailure(self.failure or f"a tensor-parallel worker is gone: "
                                                        f"{e}") from e

    def check(self) -> None:
        if self.failure is not None:
            raise TensorParallelFailure(self.failure)

    def _watch(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs, 1)}
        ended = wait(list(sentinels))
        if self._closing:
            return
        rank = sentinels[ended[0]]
        self.procs[rank - 1].join(5)  # reaped: its exit code is known
        code = self.procs[rank - 1].exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else \
            f"exited with code {code}"
        self.failure = (f"tensor-parallel rank {rank} {how}; the engine cannot run steps any "
                        f"more: restart it")
        log.error(self.failure)
        abort_tp()  # a collective waiting for the dead rank fails instead of hanging

    def stop(self) -> None:
        """Asks every worker to leave the group and exit (rank 0 leaves it at the same time:
        parallel_state.destroy_tp)."""
        self._closing = True
        for conn in self.conns:
            try:
                conn.send_bytes(STOP)
            except OSError:
                pass

    def join(self, timeout: float = 10.0) -> None:
        """Waits for the stopped workers; terminates, then kills, one that outlasts `timeout`."""
        for p in self.procs:
            p.join(timeout)
            if p.is_alive():
                p.terminate()
                p.join(2)
            if p.is_alive():
                p.kill()
                p.join()
        for conn in self.conns:
            conn.close()


def _die_with_parent(parent_pid: int) -> None:
    """The kernel kills this process when rank 0's dies (Linux), however rank 0 ends."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # rank 0 died before the signal was armed
        os._exit(1)


def worker_main(rank: int, size: int, init_method: str, cfg, model_dir: Path,
                max_model_len: int, build_runner: BuildRunner, conn: Connection,
                parent_pid: int) -> None:
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hang_s := os.environ.get("NANOSERVE_TP_HANG_DUMP_S"):  # diagnostics: a hang's stacks
        faulthandler.dump_traceback_later(float(hang_s), exit=False)
    logging.basicConfig(level=logging.WARNING, format=f"[tp{rank}] %(levelname)s %(message)s")
    # tqdm's default lock is a named semaphore, which this process's os._exit would leave for
    # the resource tracker to report as leaked; a worker's bars are disabled anyway
    tqdm.set_lock(threading.RLock())
    device = rank_device(cfg.torch_device, rank)
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        init_tp(rank, size, init_method, device)
        runner = build_runner(cfg, model_dir, max_model_len, device)
        conn.send(("ready", None))
        while (data := conn.recv_bytes()) != STOP:
            runner.execute(pickle.loads(data))
        # stopped: leave the group together with rank 0, graphs (and their captured
        # collectives) released first
        del runner
        gc.collect()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        destroy_tp()
    except EOFError:  # rank 0 closed the pipe: it is gone
        pass
    except BaseException as e:
        log.error("rank %d failed:\n%s", rank, traceback.format_exc())
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
