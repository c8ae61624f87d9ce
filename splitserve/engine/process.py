"""One engine instance as a process: a busy loop around EngineCore, with socket I/O on threads.

    input thread:  DEALER <id>/in  --decode--> inbox (queue.Queue)
    main thread:   drain inbox -> add/abort/set-role -> core.step() -> outbox
    output thread: outbox --encode--> DEALER <id>/out   (and a heartbeat when idle)

A long forward pass never blocks receiving: aborts queue up in the inbox and are applied
before the next step. `splitserve serve` starts these with `--config-stdin` and writes the
EngineConfig it built (msgspec) to our stdin; `splitserve engine --role R --connect ADDR` starts
one by hand from flags (it joins a running frontend with its hello, and joins again when a
frontend restarted on the same address answers it with ResendHello). The KV threads live inside
the core's connector (engine/connectors.py); while only transfers are in flight the loop waits
briefly on the inbox instead of spinning. A SetRole swaps the connector once the old one is
idle and is answered with RoleChanged. An error while handling one request fails that request,
never this process.
"""
from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import sys
import threading
import time

import msgspec
import zmq
import zmq.utils.monitor

from splitserve.config import (DTYPES, PREFILL_POLICIES, ROLES, SCHEDULING_POLICIES, WEIGHT_FORMATS, CacheConfig,
                               EngineConfig, SchedulerConfig)
from splitserve.devices import check_device
from splitserve.link_security import EngineLinkSecurity, add_engine_link_arguments, engine_link_from_args
from splitserve.kv_transfer import add_kv_arguments, kv_config_from_args
from splitserve.protocol import (AbortRequests, Codec, EngineHello, GenerateRequest, Heartbeat, KVTransferReport,
                                 Released, ReleaseUnstarted, ResendHello, RoleChanged, SetChunkTokens, SetRole,
                                 SetStreamCap, Shutdown, StepOutputs, TokenOutput, decode_engine_config,
                                 socket_identity)
from splitserve.sampling import SamplingParams

log = logging.getLogger("splitserve.engine")

STATS_INTERVAL_S = 0.25
HEARTBEAT_INTERVAL_S = 0.25  # the frontend declares an engine dead after --engine-silence-timeout (1.5 s)
PARENT_CHECK_INTERVAL_S = 1.0
TRANSFER_POLL_S = 0.001


HANDSHAKE_FAILURES = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                      zmq.EVENT_HANDSHAKE_FAILED_AUTH)
HANDSHAKE_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | sum(HANDSHAKE_FAILURES)


def transfer_report(record, outcome: str | None) -> KVTransferReport | None:
    """The wire subset of a kv_transfer TransferRecord, with the outcome the connector decided."""
    if record is None:
        return None
    wait = max(0.0, record.start - record.queued_at) if record.start and record.queued_at else 0.0
    return KVTransferReport(outcome or "failed", record.source_instance, record.transport, record.num_bytes,
                            record.seconds, wait, record.error, record.error_kind)


def to_wire(o) -> TokenOutput:
    """An engine RequestOutput as the frontend gets it."""
    return TokenOutput(request_id=o.request_id, new_token_ids=o.new_token_ids, finished=o.finished,
                       finish_reason=o.finish_reason, num_prompt_tokens=o.num_prompt_tokens,
                       num_cached_tokens=o.num_cached_tokens, error=o.error, kv_descriptor=o.kv_descriptor,
                       kv_transfer=transfer_report(o.kv_transfer, o.kv_outcome), logprobs=o.logprobs,
                       prompt_logprobs=o.prompt_logprobs)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments an engine needs; `serve` shares them and builds each engine's EngineConfig from them."""
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: bundled SmolLM2-135M)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="of weights, activations and the KV pool (bfloat16: what a GPU serves in; the C++ CPU "
                        "kernels are fp32 only, so on the CPU bfloat16 runs the slower torch path)")
    p.add_argument("--threads-per-instance", type=int, default=None, help="torch threads per engine (serve's default: its cores / engines)")
    p.add_argument("--prefill-policy", choices=PREFILL_POLICIES, default="chunked")
    p.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs",
                   help="priority: admit waiting prompts by the request's priority (lower first, then arrival) "
                        "and preempt the lowest priority first")
    p.add_argument("--max-num-batched-tokens", type=int, default=256, help="token budget per step")
    p.add_argument("--max-num-seqs", type=int, default=64, help="running requests per engine")
    p.add_argument("--kv-cache-memory", default="1GiB", help="KV pool size per engine, e.g. 512MiB")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weight-format", choices=WEIGHT_FORMATS, default="auto",
                   help="gguf: keep a GGUF's Q4_1/Q8_0 blocks (~5x fewer bytes a decode step, same greedy "
                        "tokens); gguf-q8act: gguf, and decode steps of 1-2 streams multiply 8-bit activations "
                        "in integers as llama.cpp does (~1.5x faster per stream on AVX2; greedy tokens may "
                        "differ from transformers' at near-ties); auto: gguf when the model is a GGUF on the "
                        "CPU and the kernels are built")
    p.add_argument("--kv-failure-policy", choices=("recompute", "fail"), default="recompute",
                   help="decode role, when a KV transfer fails: prefill the prompt again, or fail the request")
    add_kv_arguments(p)
    p.set_defaults(engine_link_secret=None)  # bytes `serve` generated or read, for its engines' configs


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    p.add_argument("--connect", required=True, help="the frontend's engine address, e.g. tcp://127.0.0.1:5555")
    p.add_argument("--engine-id", default=None, help="unique name (default: engine-<pid>)")
    p.add_argument("--role", choices=ROLES, default="colocated")
    p.add_argument("--cpus", default=None, help="pin to these cores, e.g. '0,1' or '2-3'")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    p.add_argument("--config-stdin", action="store_true",
                   help="read the EngineConfig (msgpack, as `serve` writes it) from stdin instead of the flags")
    add_engine_link_arguments(p)


def engine_config_from_args(args: argparse.Namespace, role: str = "colocated",
                            instance_id: str = "engine-0") -> EngineConfig:
    """Every instance gets the KV settings, whatever its first role: a live role change may need them."""
    return EngineConfig(
        instance_id=instance_id, role=role, kv_transfer=kv_config_from_args(args),
        kv_failure_policy=args.kv_failure_policy,
        model=args.model, device=args.device, num_threads=args.threads_per_instance, seed=args.seed,
        weight_format=args.weight_format, dtype=args.dtype, link_secret=args.engine_link_secret,
        local_prefill_chunk_tokens=getattr(args, "local_prefill_chunk_tokens", None),  # serve's policy sets it
        kernels=getattr(args, "kernels", "auto"),  # serve --kernels
        kernel_rows=getattr(args, "kernel_rows", None),  # serve --kernel-rows (None: auto)
        cache=CacheConfig(block_size=args.block_size, kv_cache_memory=args.kv_cache_memory),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  prefill_policy=args.prefill_policy,
                                  scheduling_policy=args.scheduling_policy))


def parse_cpus(text: str) -> set[int]:
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"--cpus {text!r}: write core numbers like '0,1' or '2-3'") from None
    return cpus


class EngineProcess:
    def __init__(self, core, engine_id: str, connect: str, parent_pid: int | None = None,
                 link: EngineLinkSecurity | None = None) -> None:
        self.core, self.engine_id = core, engine_id
        self.connect, self.parent_pid, self.link = connect, parent_pid, link
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        self.stopping = threading.Event()
        self.refused: str | None = None  # why the frontend refused our handshake (we then leave)
        self.ctx = zmq.Context()

    def _socket(self, direction: str) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, socket_identity(self.engine_id, direction))
        sock.setsockopt(zmq.LINGER, 1000)
        if self.link is not None:
            self.link.secure_client(sock)
        sock.connect(self.connect)
        return sock

    def hello(self) -> EngineHello:
        stats = self.core.stats()
        mc = self.core.model_config
        return EngineHello(self.engine_id, self.core.role, self.core.model_name, self.core.max_model_len,
                           mc.vocab_size, stats.num_blocks_total, stats.block_size,
                           self.core.config.scheduler.max_num_seqs, os.getpid())

    def _refusal(self) -> str:
        """What to tell a hand-started engine whose handshake the frontend refused."""
        where = f"the frontend at {self.connect} refused this engine's handshake"
        if self.link is None:
            return (f"{where}: it requires the engine-link secret and this engine has none; start it "
                    "with --engine-secret-file FILE, the file serve was given (a serve that generated "
                    "its own secret admits only the engines it started)")
        # A different secret means a different server key too, so it fails like a frontend without one
        return (f"{where}: our engine-link secret is not the frontend's (or the frontend uses none); "
                "give the same --engine-secret-file to serve and to this engine")

    def _watch_handshake(self, monitor: zmq.Socket) -> bool:
        """One monitor event -> whether to keep watching. Without this, a peer the frontend
        refuses (no secret, another secret) would wait forever: ZMQ retries silently."""
        event = zmq.utils.monitor.recv_monitor_message(monitor)["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            return False
        if event in HANDSHAKE_FAILURES:
            self.refused = self._refusal()
            log.error("engine %s: %s", self.engine_id, self.refused)
            self.stopping.set()
            return False
        return True

    def _input_thread(self) -> None:
        codec, sock = Codec(), self._socket("in")
        monitor: zmq.Socket | None = sock.get_monitor_socket(HANDSHAKE_EVENTS)
        sock.send(codec.encode(self.hello()))  # after this the frontend may route to us
        while not self.stopping.is_set():
            if monitor is not None and monitor.poll(0) and not self._watch_handshake(monitor):
                sock.disable_monitor()
                monitor.close()
                monitor = None
            if not sock.poll(100):
                continue
            payload = sock.recv()
            try:
                self.inbox.put(codec.to_engine.decode(payload))
            except msgspec.DecodeError as e:
                log.warning("dropping an undecodable message (%d bytes): %s", len(payload), e)
        if monitor is not None:
            sock.disable_monitor()
            monitor.close()
        sock.close()

    def _output_thread(self) -> None:
        codec, sock = Codec(), self._socket("out")
        while True:
            try:
                message = self.outbox.get(timeout=HEARTBEAT_INTERVAL_S)
            except queue.Empty:
                message = Heartbeat(self.engine_id)
            if message is None:  # the main loop is done: everything before it is sent
                break
            sock.send(codec.encode(message))
        sock.close()

    def _reject(self, request_id: str, why: str) -> TokenOutput:
        return TokenOutput(request_id, [], True, "error", error=why, rejected=True)

    def _add(self, msg: GenerateRequest) -> TokenOutput | None:
        try:
            params = SamplingParams(**msgspec.structs.asdict(msg.params))
            self.core.add_request(msg.request_id, msg.prompt_token_ids, params,
                                  kv_descriptor=msg.kv_descriptor, first_token_ids=msg.first_token_ids or None,
                                  priority=msg.priority, ttft_due_in_s=msg.ttft_due_in_s)
        except (ValueError, TypeError) as e:
            return self._reject(msg.request_id, str(e))
        except Exception as e:  # noqa: BLE001 - a bug met by one request must not end the engine
            log.exception("engine %s: adding request %s failed", self.engine_id, msg.request_id)
            self.core.abort_request(msg.request_id)
            return TokenOutput(msg.request_id, [], True, "error", error=f"engine error: {type(e).__name__}: {e}")
        return None

    def _set_role(self, role: str) -> None:
        try:
            self.core.change_role(role)
        except ValueError as e:
            self.outbox.put(RoleChanged(self.engine_id, self.core.role, str(e)))
            return
        self._swap_role()

    def _swap_role(self) -> None:
        if self.core.pending_role is None:
            self.outbox.put(RoleChanged(self.engine_id, self.core.role))
            return
        try:
            swapped = self.core.try_swap_role()
        except ValueError as e:
            self.outbox.put(RoleChanged(self.engine_id, self.core.role, str(e)))
            return
        if swapped:
            self.outbox.put(RoleChanged(self.engine_id, self.core.role, released=self.core.released))
            self.outbox.put(self.core.stats())

    def _apply(self, message) -> list[TokenOutput]:
        rejected = []
        if isinstance(message, GenerateRequest):
            out = self._add(message)
            if out is not None:
                rejected.append(out)
        elif isinstance(message, AbortRequests):
            for request_id in message.request_ids:
                try:
                    self.core.abort_request(request_id)
                except Exception:  # noqa: BLE001
                    log.exception("engine %s: aborting request %s failed", self.engine_id, request_id)
        elif isinstance(message, SetRole):
            self._set_role(message.role)
        elif isinstance(message, ReleaseUnstarted):
            self.outbox.put(Released(self.engine_id, self.core.release_unstarted(set(message.request_ids))))
        elif isinstance(message, SetChunkTokens):
            try:
                self.core.set_chunk_tokens(message.tokens or None)
            except ValueError as e:
                log.error("engine %s: chunk tokens not changed: %s", self.engine_id, e)
        elif isinstance(message, SetStreamCap):
            try:
                self.core.set_max_streams(message.streams or None)
            except ValueError as e:
                log.error("engine %s: stream cap not changed: %s", self.engine_id, e)
        elif isinstance(message, ResendHello):
            log.warning("engine %s: the frontend does not know us (it restarted); dropping %d requests "
                        "and saying hello again", self.engine_id, len(self.core.requests))
            self.core.abort_all()
            self.outbox.put(self.hello())
        elif isinstance(message, Shutdown):
            log.info("engine %s: shutdown requested (%s)", self.engine_id, message.reason)
            self.stopping.set()
        return rejected

    def _step(self) -> list:
        try:
            return self.core.step()
        except Exception as e:  # noqa: BLE001 - fail what is in flight, keep serving
            log.exception("engine %s: step failed; failing every request in flight", self.engine_id)
            outputs = []
            for request_id in list(self.core.requests):
                self.core.abort_request(request_id)
                outputs.append(TokenOutput(request_id, [], True, "error", error=f"engine error: {type(e).__name__}: {e}"))
            return outputs

    def _parent_gone(self) -> bool:
        return self.parent_pid is not None and os.getppid() != self.parent_pid

    def run(self) -> None:
        threads = [threading.Thread(target=self._input_thread, name="engine-in", daemon=True),
                   threading.Thread(target=self._output_thread, name="engine-out", daemon=True)]
        for t in threads:
            t.start()
        # Stats go out after anything changed, at most every STATS_INTERVAL_S, so an idle
        # engine costs the frontend nothing but the output thread's heartbeats.
        next_stats, changed, next_parent_check = 0.0, True, 0.0
        while not self.stopping.is_set():
            busy = self.core.has_unfinished_requests()
            turn_started, steps_before = time.perf_counter(), self.core.num_steps
            outputs: list[TokenOutput] = []
            try:  # idle: sleep on the inbox (until stats are due); busy: take what is there
                if busy:
                    message = self.inbox.get_nowait()
                else:
                    wait = max(0.0, next_stats - time.monotonic()) if changed else PARENT_CHECK_INTERVAL_S
                    message = self.inbox.get(timeout=wait)
                changed = True
                outputs += self._apply(message)
                while True:
                    outputs += self._apply(self.inbox.get_nowait())
            except queue.Empty:
                pass
            if self.core.pending_role is not None:
                self._swap_role()
            if self.core.has_unfinished_requests() and not self.stopping.is_set():
                changed = True
                outputs += [to_wire(o) for o in self._step()]
                if not self.core.scheduler.has_unfinished():
                    # Only KV transfers in flight (puller threads, a held lease): wait a little for
                    # them or for a message instead of spinning a core the other engines need.
                    try:
                        outputs += self._apply(self.inbox.get(timeout=TRANSFER_POLL_S))
                    except queue.Empty:
                        pass
            if outputs:
                self.outbox.put(StepOutputs(self.engine_id, outputs))
            if busy:  # a turn that waited for work would count the wait
                self.core.note_loop_seconds(steps_before, time.perf_counter() - turn_started)
            now = time.monotonic()
            # early when the step samples would overflow (fast steps): every step reaches GET /admin/steps
            if changed and (now >= next_stats or self.core.step_samples_full):
                self.outbox.put(self.core.stats())
                next_stats, changed = now + STATS_INTERVAL_S, False
            if now >= next_parent_check:
                next_parent_check = now + PARENT_CHECK_INTERVAL_S
                if self._parent_gone():
                    log.error("engine %s: parent process is gone; exiting", self.engine_id)
                    self.stopping.set()
        self.outbox.put(None)
        self.core.close()
        for t in threads:
            t.join(timeout=2)
        self.ctx.term()
        log.info("engine %s stopped", self.engine_id)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.cpus:
        os.sched_setaffinity(0, parse_cpus(args.cpus))
    engine_id = args.engine_id or f"engine-{os.getpid()}"
    try:
        if args.config_stdin:
            config = decode_engine_config(sys.stdin.buffer.read())
            engine_id = config.instance_id
        else:
            config = engine_config_from_args(args, args.role, engine_id)
        link = (EngineLinkSecurity(config.link_secret) if config.link_secret is not None
                else engine_link_from_args(args, args.connect, "--connect"))
        check_device(config.device)
    except (ValueError, msgspec.ValidationError, msgspec.DecodeError) as e:
        log.error("engine %s: %s", engine_id, e)
        return 2
    import torch  # after pinning, so torch's thread pool starts on the allowed cores

    if config.num_threads:
        torch.set_num_threads(config.num_threads)
        torch.set_num_interop_threads(1)
    from splitserve.engine.core import EngineCore

    process: EngineProcess | None = None

    def stop(signum, frame) -> None:  # SIGTERM / SIGINT: finish the current step, then leave
        if process is not None:
            process.stopping.set()
        else:
            raise SystemExit(0)

    # The I/O threads need the GIL for microseconds; at Python's default 5 ms switch interval
    # a step's Python code could hold them (and every token's delivery) back that long.
    sys.setswitchinterval(0.0005)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    core = EngineCore(config)
    process = EngineProcess(core, engine_id, args.connect, args.parent_pid, link)
    log.info("engine %s (%s) connecting to %s", engine_id, config.role, args.connect)
    process.run()
    return 3 if process.refused else 0
