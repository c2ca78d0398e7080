"""Span ingest benchmark: decode + normalize + commit into SQLite, end to end, on one core.

Four runs side by side, each into a fresh SQLite file:
- ``stages``: one thread normalizes (decoding included) and inserts, timing each step (CPU per span);
- ``in-process``: protobuf bodies decoded, normalized and committed by the SpanWriter, no HTTP;
- ``sustained``: several closed-loop senders POST 512-span OTLP/HTTP protobuf requests to the
  receiver (the receiver process pinned to one core; senders in another process on other cores);
- ``flood``: many senders that ignore Retry-After and resend a refused body at once, offering as
  much as they can (the goal: at least ten times the sustained rate), with 1024-span requests;
  memory must stay bounded and the excess be refused with 429/503.

``--otlp grpc`` sends the over-the-wire phases as OTLP/gRPC calls (grpcio's client, a channel per
sender) to the gRPC receiver instead; refusals are counted in the 429/503 columns by their gRPC
codes (RESOURCE_EXHAUSTED, UNAVAILABLE).

Trace ids are random, as exporters make them (``--ordered-ids``: in counting order, as this bench
sent them before; an index takes those on one page per body). The values that change from request
to request in service (the client's port, token counts, latencies) change in every span too, so
the reader's cache of key-values misses on them as it does there (``--repeated-values``: every
body carries the template's, as this bench sent them before). Prints a table (or ``--json``).
Figures depend on the machine and on what else runs on it.
``--phases`` picks the phases. ``--compare REV`` measures the receiver code of git revision REV
and of the working tree alternately, ``--rounds`` times each, each run in its own process with
the same bench driving it: on a shared machine only figures taken side by side compare.
``--reader python|compiled`` reads bodies with that OTLP byte reader (``collectors.otlp_wire``;
default: the compiled one where it was built); ``--compare-readers`` runs the working tree with
each, alternately, as ``--compare`` does with two trees. ``--builder`` and ``--compare-builders``
do the same with the span record builder (``collectors.normalize.build_span`` or its compiled twin).
``--from-container`` normalizes the in-process and stages phases' spans as sent from a container's
own address, which the receivers keep on each span; ``--compare-senders`` runs the working tree
with and without it, alternately.
"""

from __future__ import annotations

import argparse
import gc
import http.client
import io
import json
import os
import random
import statistics
import struct
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

# This script's own tree first (not the one the virtualenv was installed from), unless
# PYTHONPATH names one: the children --compare starts for another revision.
if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

# Parts of the template replaced in every request, so that each request carries new, realistic
# values: unique trace ids, unique request ids, and times that move forward (indexes see the
# insert pattern of real traffic, not the same keys again and again).
MARKER = bytes.fromhex("9e3779b97f4a7c15")  # trace-id prefix
ID_MARKER = "f00dfacef00dface"  # inside request ids
TIME_MARKER = 0x5A5AA5A5  # upper 32 bits of start/end times (little-endian in fixed64 fields)
TIME_BASE = 0x17970000  # upper 32 bits of real times around late 2023
TARGET_SPANS_PER_S = 60_000  # per second of one core, sustained over HTTP
PHASES = ("stages", "in-process", "sustained", "flood")
PAGE = os.sysconf("SC_PAGE_SIZE")
ORDERED_IDS = False  # --ordered-ids: trace ids in order, as this bench sent them before
REPEATED_VALUES = False  # --repeated-values: the template's values in every body, as before
# --from-container: the in-process and stages phases' spans as an engine in a container sends them,
# from an address of its own, which the receivers keep on each span (auditor.sender_address).
FROM_CONTAINER = "10.244.1.5"
SENDER: str | None = None
# Attribute values that differ from request to request in service, each drawn anew for every span
# of every body, in a range whose encoding has the template value's length (3-byte varints for
# ports, 2-byte for token counts, 8 bytes for doubles), so each is written where the template's was.
VARIED = {"net.peer.port": (16_384, 65_535), "gen_ai.usage.prompt_tokens": (128, 16_383),
          "gen_ai.usage.completion_tokens": (128, 16_383), "gen_ai.latency.time_in_queue": (0.0, 0.5),
          "gen_ai.latency.time_to_first_token": (0.0, 2.0), "gen_ai.latency.e2e": (0.5, 30.0)}


def template_body(batch: int) -> bytes:
    """One request of ``batch`` spans, half ASGI server spans and half vLLM llm_request spans."""
    return bytes(template_request(batch).SerializeToString())


def template_request(batch: int) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    for key, value in {"service.name": "vllm", "host.name": "gpu-1", "process.pid": 4242}.items():
        attribute = resource_spans.resource.attributes.add(key=key)
        if isinstance(value, int):
            attribute.value.int_value = value
        else:
            attribute.value.string_value = value
    spans = resource_spans.scope_spans.add().spans
    for i in range(batch):
        start = (TIME_MARKER << 32) | (i * 4000)
        span = spans.add(trace_id=MARKER + i.to_bytes(8, "big"), span_id=(i + 1).to_bytes(8, "big"),
                         kind=2, start_time_unix_nano=start, end_time_unix_nano=start + 2_000_000)
        if i % 2:
            span.name = "POST /v1/chat/completions"
            attributes: dict[str, Any] = {
                "http.method": "POST", "http.route": "/v1/chat/completions", "http.scheme": "http",
                "net.peer.ip": "10.0.0.7", "net.peer.port": 40000 + i % 20000, "net.host.port": 8000,
                "http.status_code": 200, "http.flavor": "1.1", "http.user_agent": "python-httpx/0.27",
                "http.request.header.x_request_id": f"req-{ID_MARKER}-{i}"}
        else:
            span.name = "llm_request"
            attributes = {
                "gen_ai.request.id": f"chatcmpl-req-{ID_MARKER}-{i}", "gen_ai.usage.prompt_tokens": 812,
                "gen_ai.usage.completion_tokens": 128, "gen_ai.request.max_tokens": 256,
                "gen_ai.latency.time_in_queue": 0.012, "gen_ai.latency.time_to_first_token": 0.21,
                "gen_ai.latency.e2e": 2.4, "gen_ai.response.model": "llama-3-8b",
                "gen_ai.request.temperature": 0.7, "gen_ai.response.finish_reasons": "stop"}
        for key, value in attributes.items():
            attribute = span.attributes.add(key=key)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                attribute.value.string_value = str(value)
            elif isinstance(value, int):
                attribute.value.int_value = value
            else:
                attribute.value.double_value = value
    return request


def varint(value: int) -> bytes:
    """``value`` as protobuf writes an int64 field's value (the field's tag byte left off)."""
    return bytes(AnyValue(int_value=value).SerializeToString()[1:])


def varied_places(request: ExportTraceServiceRequest, body: bytes) -> list[tuple[int, int, Any]]:
    """Where each VARIED value of ``body`` lies: (offset, encoded length, its range), found from
    each span's own encoding (unique: its trace id) and its key-value's within it."""
    places = []
    for span in request.resource_spans[0].scope_spans[0].spans:
        encoded = span.SerializeToString()
        span_at = body.index(encoded)
        for attribute in span.attributes:
            if attribute.key not in VARIED:
                continue
            pair = attribute.SerializeToString()
            is_int = attribute.value.WhichOneof("value") == "int_value"
            size = len(varint(attribute.value.int_value)) if is_int else 8
            places.append((span_at + encoded.index(pair) + len(pair) - size, size, VARIED[attribute.key]))
    return places


class Bodies:
    """Unique bodies from one template. Every span gets a random trace id, as exporters make them:
    the store's trace-id index then takes each span on a page of its own, as it does in service.
    With ``ordered_ids`` the ids are a counter instead (each body's prefix), which inserts them in
    order: the figures of this bench before it sent random ids."""

    def __init__(self, batch: int, seed: int, ordered_ids: bool | None = None,
                 repeated_values: bool | None = None) -> None:
        request = template_request(batch)
        self.template = bytes(request.SerializeToString())
        self.lock = threading.Lock()
        self.counter = seed << 40
        self.ordered_ids = ORDERED_IDS if ordered_ids is None else ordered_ids
        repeated = REPEATED_VALUES if repeated_values is None else repeated_values
        self.random = random.Random(seed)
        self.trace_ids_at = [self.template.index(MARKER + i.to_bytes(8, "big")) for i in range(batch)]
        self.varied_at = [] if repeated else varied_places(request, self.template)

    def next(self) -> bytes:
        with self.lock:
            self.counter += 1
            counter = self.counter
        body = self.template.replace(MARKER, counter.to_bytes(8, "big"))
        body = body.replace(ID_MARKER.encode(), f"{counter:016x}".encode())
        # Each request is ~4.3 s later than the one before (upper dword + 1): times only move forward.
        moved = (TIME_BASE + (counter & 0xFFFFF)).to_bytes(4, "little")
        body = body.replace(TIME_MARKER.to_bytes(4, "little"), moved)
        if self.ordered_ids and not self.varied_at:
            return body
        out = bytearray(body)  # every replacement above keeps lengths: the ids are where they were
        with self.lock:
            if not self.ordered_ids:
                ids = self.random.randbytes(16 * len(self.trace_ids_at))
                for n, at in enumerate(self.trace_ids_at):
                    out[at:at + 16] = ids[16 * n:16 * n + 16]
            for at, size, (low, high) in self.varied_at:
                if size == 8:
                    out[at:at + 8] = struct.pack("<d", self.random.uniform(low, high))
                else:
                    out[at:at + size] = varint(self.random.randint(low, high))
        return bytes(out)


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE


# -- sender process ---------------------------------------------------------------------------------
TRACE_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def run_senders(port: int, senders: int, seconds: float, batch: int, seed: int, otlp: str = "http") -> dict[str, Any]:
    bodies = Bodies(batch, seed)
    statuses: Counter[int] = Counter()
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def grpc_sender() -> None:
        import grpc  # the sender's client only; the receiver under test never imports it

        local: Counter[int] = Counter()
        as_http = {grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503}
        body = bodies.next()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            export = channel.unary_unary(TRACE_METHOD)
            while time.monotonic() < deadline:
                try:
                    export(body, timeout=60)
                except grpc.RpcError as exc:
                    local[as_http.get(exc.code(), 1000 + exc.code().value[0])] += 1
                    continue  # a refused body is sent again, as exporters do
                local[200] += 1
                body = bodies.next()
        with lock:
            statuses.update(local)

    def sender() -> None:
        conn: http.client.HTTPConnection | None = None
        local: Counter[int] = Counter()
        body = bodies.next()
        while time.monotonic() < deadline:
            try:
                if conn is None:
                    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                conn.request("POST", "/v1/traces", body=body, headers={"Content-Type": "application/x-protobuf"})
                response = conn.getresponse()
                response.read()
                local[response.status] += 1
                if response.status == 200:  # a refused body is sent again, as exporters do
                    body = bodies.next()
                if response.will_close:
                    conn.close()
                    conn = None
            except (OSError, http.client.HTTPException):
                local[0] += 1  # connection refused or dropped: counted, retried
                if conn is not None:
                    conn.close()
                conn = None
        if conn is not None:
            conn.close()
        with lock:
            statuses.update(local)

    threads = [threading.Thread(target=grpc_sender if otlp == "grpc" else sender) for _ in range(senders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"statuses": dict(statuses), "spans_offered": sum(statuses.values()) * batch}


# -- receiver side ----------------------------------------------------------------------------------
class Watch:
    """Samples RSS and queue depth while a phase runs."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer
        self.peak_rss = rss_bytes()
        self.peak_queue = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.wait(0.02):
            self.peak_rss = max(self.peak_rss, rss_bytes())
            self.peak_queue = max(self.peak_queue, self.writer.queue_depth_spans)

    def done(self) -> None:
        self.stop.set()
        self.thread.join()


def body_normalizer() -> Any:
    """The receivers' way from a protobuf body to span records: read from the bytes where the
    tree has ``collectors.otlp_wire`` (the message parsed where that reader declines), else parse
    then normalize. --compare runs older trees through the same function."""
    from collectors.normalize import normalize_request
    from collectors.otlp_codec import PROTOBUF, decode_request

    sent_from = {"sender": SENDER} if SENDER else {}

    def parsed(body: bytes) -> Any:
        return normalize_request(decode_request(body, PROTOBUF), service_host="bench", **sent_from)

    try:
        from collectors.normalize import normalize_body
        from collectors.otlp_wire import Unusual
    except ImportError:
        return parsed

    def read(body: bytes) -> Any:
        try:
            return normalize_body(body, service_host="bench", **sent_from)
        except Unusual:
            return parsed(body)

    return read


def in_process(batch: int, seconds: float, workdir: Path) -> dict[str, Any]:
    from auditor.store import Store
    from collectors.spanwriter import SpanWriter

    store = Store(f"sqlite:///{workdir / 'inproc.db'}")
    writer = SpanWriter(store).start()
    normalize = body_normalizer()
    bodies = Bodies(batch, seed=1)
    watch = Watch(writer)
    cpu_started, started, requests = time.process_time(), time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        writer.submit(normalize(bodies.next()).spans)
        requests += 1
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    watch.done()
    committed = writer.committed_spans
    writer.stop()
    store.close()
    return {"phase": "in-process", "senders": 1, "seconds": elapsed, "offered": requests * batch / elapsed,
            "committed": committed / elapsed, "per_cpu_second": committed / cpu, "cpu_share": cpu / elapsed,
            "refused_429": 0, "refused_503": 0, "peak_rss_mib": watch.peak_rss / 2**20, "peak_queue": watch.peak_queue}


def stages(batch: int, seconds: float, workdir: Path) -> dict[str, Any]:
    """One thread, no queue: CPU time per span of each step, the store written four requests at a
    time (about what group commit gathers in the sustained phase)."""
    from auditor.store import Store

    store = Store(f"sqlite:///{workdir / 'stages.db'}")
    normalize = body_normalizer()
    bodies = Bodies(batch, seed=2)
    spent = {"normalize": 0.0, "insert": 0.0}  # normalize: decoding the body included
    clock = time.thread_time
    spans_done = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        group = [bodies.next() for _ in range(4)]
        t0 = clock()
        spans = [span for body in group for span in normalize(body).spans]
        t2 = clock()
        store.write(spans)
        t3 = clock()
        for name, took in zip(spent, (t2 - t0, t3 - t2), strict=True):
            spent[name] += took
        spans_done += len(spans)
    elapsed, cpu = time.perf_counter() - started, sum(spent.values())
    store.close()
    return {"phase": "stages", "senders": 0, "seconds": elapsed, "offered": spans_done / elapsed,
            "committed": spans_done / elapsed, "per_cpu_second": spans_done / cpu, "cpu_share": cpu / elapsed,
            "refused_429": 0, "refused_503": 0, "peak_rss_mib": rss_bytes() / 2**20, "peak_queue": 0,
            "us_per_span": {name: value / spans_done * 1e6 for name, value in spent.items()}}


def over_http(phase: str, senders: int, processes: int, batch: int, seconds: float, workdir: Path,
              sender_cpus: set[int] | None, max_queue_spans: int, otlp: str = "http") -> dict[str, Any]:
    from auditor.store import Store
    from collectors.spanwriter import SpanWriter

    store = Store(f"sqlite:///{workdir / f'{phase}.db'}")
    writer = SpanWriter(store, max_queue_spans=max_queue_spans).start()
    receiver: Any
    if otlp == "grpc":
        from collectors.otlp_grpc import OtlpGrpcReceiver
        receiver = OtlpGrpcReceiver(writer, port=0).start()  # default limits (64 calls at once)
    else:
        from collectors.otlp_http import OtlpHttpReceiver
        receiver = OtlpHttpReceiver(writer, port=0).start()  # default connection cap (64)
    watch = Watch(writer)
    before = writer.committed_spans
    cpu_started, started = time.process_time(), time.perf_counter()
    # Several sender processes (threads share a GIL): the flood must not be limited by its senders.
    per_process = [senders // processes + (1 if i < senders % processes else 0) for i in range(processes)]
    children = [subprocess.Popen(
        [sys.executable, __file__, "--sender", "--port", str(receiver.port), "--senders", str(count),
         "--seconds", str(seconds), "--batch", str(batch), "--seed", str(random.randrange(1, 10**6)),
         "--otlp", otlp, *(["--ordered-ids"] if ORDERED_IDS else []),
         *(["--repeated-values"] if REPEATED_VALUES else [])],
        stdout=subprocess.PIPE, text=True,
        preexec_fn=(lambda: os.sched_setaffinity(0, sender_cpus)) if sender_cpus else None)
        for count in per_process if count]
    results = [json.loads(child.communicate()[0]) for child in children]
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    watch.done()
    committed = writer.committed_spans - before
    statuses: Counter[int] = Counter()
    for result in results:
        statuses.update({int(k): v for k, v in result["statuses"].items()})
    receiver.stop()
    writer.stop()
    store.close()
    offered = sum(result["spans_offered"] for result in results)
    return {"phase": phase, "senders": senders, "seconds": elapsed, "offered": offered / elapsed,
            "committed": committed / elapsed, "per_cpu_second": committed / cpu, "cpu_share": cpu / elapsed,
            "refused_429": statuses.get(429, 0),
            "refused_503": statuses.get(503, 0), "other": {k: v for k, v in statuses.items() if k not in (200, 429, 503)},
            "peak_rss_mib": watch.peak_rss / 2**20, "peak_queue": watch.peak_queue}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """The chosen phases in this process, the receiver pinned to the first allowed core."""
    if args.reader:
        from collectors import otlp_wire

        if args.reader not in otlp_wire.READERS:
            raise SystemExit(f"no {args.reader} OTLP reader here: `make setup` builds the compiled one")
        otlp_wire.use_reader(args.reader)
    if args.builder:
        from collectors import normalize

        if args.builder not in normalize.BUILDERS:
            raise SystemExit(f"no {args.builder} span record builder here: `make setup` builds the compiled one")
        normalize.use_builder(args.builder)
    cpus = sorted(os.sched_getaffinity(0))
    sender_cpus = set(cpus[1:]) or None
    os.sched_setaffinity(0, {cpus[0]})  # decode, normalize and commit share one core
    if args.gc_threshold:  # what a daemon would get from a larger first GC generation
        gc.set_threshold(args.gc_threshold, *gc.get_threshold()[1:])
    rows = []
    with tempfile.TemporaryDirectory(prefix="ingest-bench-") as scratch:
        workdir = Path(scratch)
        if "stages" in args.phases:
            rows.append(stages(args.batch, args.seconds, workdir))
        if "in-process" in args.phases:
            rows.append(in_process(args.batch, args.seconds, workdir))
        if "sustained" in args.phases:
            rows.append(over_http("sustained", args.senders, 1, args.batch, args.seconds, workdir,
                                  sender_cpus, args.max_queue_spans, args.otlp))
        if "flood" in args.phases:
            rows.append(over_http("flood", args.flood_senders, args.flood_processes, args.flood_batch,
                                  args.seconds, workdir, sender_cpus, args.max_queue_spans, args.otlp))
    by_phase = {row["phase"]: row for row in rows}
    sustained, flood = by_phase.get("sustained"), by_phase.get("flood")
    return {"cpus": len(cpus), "receiver_cpu": cpus[0], "load_average": os.getloadavg()[0], "otlp": args.otlp,
            "batch": args.batch, "flood_batch": args.flood_batch, "target_spans_per_s": TARGET_SPANS_PER_S,
            "flood_vs_sustained": flood["offered"] / sustained["committed"] if sustained and flood else None,
            "rows": rows}


def print_table(summary: dict[str, Any]) -> None:
    print(f"span ingest over OTLP/{summary['otlp'].upper()}, {summary['batch']} spans/request ({summary['flood_batch']} in the flood), receiver "
          f"pinned to cpu {summary['receiver_cpu']} of {summary['cpus']}, load average {summary['load_average']:.1f}")
    header = (f"{'phase':<11} {'senders':>7} {'offered/s':>10} {'committed/s':>11} {'per CPU-s':>10} "
              f"{'CPU':>5} {'429':>6} {'503':>5} {'peak RSS MiB':>12} {'peak queue':>10}")
    print(header)
    print("-" * len(header))
    for row in summary["rows"]:
        print(f"{row['phase']:<11} {row['senders']:>7} {row['offered']:>10,.0f} {row['committed']:>11,.0f} "
              f"{row['per_cpu_second']:>10,.0f} {row['cpu_share']:>5.0%} {row['refused_429']:>6} "
              f"{row['refused_503']:>5} {row['peak_rss_mib']:>12.0f} {row['peak_queue']:>10,}")
        if row.get("us_per_span"):
            print("stages: CPU microseconds per span: " + ", ".join(
                f"{name} {value:.2f}" for name, value in row["us_per_span"].items()))
        if row.get("other"):
            print(f"{row['phase']}: other answers {row['other']} (0 = connection refused or reset)")
    print("per CPU-s: spans committed per second of receiver CPU time, i.e. the rate of one dedicated core; "
          "CPU: the share of its core the receiver got (the machine is shared)")
    if summary["flood_vs_sustained"] is not None:
        print(f"flood offered {summary['flood_vs_sustained']:.1f}x the sustained rate")
    sustained = next((row for row in summary["rows"] if row["phase"] == "sustained"), None)
    if sustained:
        per_core = sustained["per_cpu_second"]
        print(f"target >= {TARGET_SPANS_PER_S:,} spans/s on one core: "
              f"{'met' if per_core >= TARGET_SPANS_PER_S else 'NOT met'} ({per_core:,.0f} per CPU-second, "
              f"{sustained['committed']:,.0f} per wall-clock second)")


def export_tree(rev: str, into: Path) -> Path:
    """The packages the receiver imports, as they were at ``rev`` (git archive, no checkout); or
    ``rev`` itself when it names a folder holding such a tree (a checkout with no git history)."""
    if Path(rev).is_dir():
        return Path(rev)
    root = Path(__file__).resolve().parent.parent
    archive = subprocess.run(["git", "-C", str(root), "archive", "--format=tar", rev, "auditor", "collectors",
                              "probes", "replay"], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    build_extensions(into)
    return into


def build_extensions(tree: Path) -> None:
    """Compile the tree's C extensions (collectors/_*.c) in place, as ``make setup`` builds them for
    the working tree: without them an old tree would run its Python twins, and compare unfairly.
    One that does not compile is said, and that tree runs the Python twin."""
    include = sysconfig.get_paths()["include"]
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    for source in sorted((tree / "collectors").glob("_*.c")):
        target = source.with_name(source.stem + suffix)
        built = subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-fwrapv", f"-I{include}", str(source),
                                "-o", str(target)], capture_output=True, text=True)
        if built.returncode != 0:
            print(f"{tree}: {source.name} did not compile, the Python twin runs there: "
                  f"{built.stderr.strip().splitlines()[-1:]}", file=sys.stderr)


def compare(args: argparse.Namespace) -> None:
    """Old (``--compare REV``) and current code alternately, each run a fresh process; with
    ``--compare-readers`` (``--compare-builders``), the current code with each OTLP byte reader
    (span record builder); with ``--compare-senders``, the current code with spans sent from the
    loopback and from a container's address."""
    here = Path(__file__).resolve().parent.parent
    forwarded = ["--phases", ",".join(args.phases), "--seconds", str(args.seconds), "--batch", str(args.batch),
                 "--senders", str(args.senders), "--max-queue-spans", str(args.max_queue_spans),
                 "--gc-threshold", str(args.gc_threshold), "--otlp", args.otlp, "--json",
                 *(["--ordered-ids"] if args.ordered_ids else []),
                 *(["--repeated-values"] if args.repeated_values else [])]
    results: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="ingest-old-") as scratch:
        runs: dict[str, tuple[Path, list[str]]]
        if args.compare_readers:
            runs = {"python reader": (here, ["--reader", "python"]), "compiled": (here, ["--reader", "compiled"])}
        elif args.compare_builders:
            runs = {"python builder": (here, ["--builder", "python"]),
                    "compiled": (here, ["--builder", "compiled"])}
        elif args.compare_senders:
            runs = {"loopback": (here, []), "container": (here, ["--from-container"])}
        else:
            runs = {args.compare: (export_tree(args.compare, Path(scratch)), []), "working tree": (here, [])}
        for round_no in range(1, args.rounds + 1):
            for label, (tree, extra) in runs.items():
                env = dict(os.environ, PYTHONPATH=str(tree))
                out = subprocess.run([sys.executable, __file__, *forwarded, *extra], env=env, check=True,
                                     capture_output=True, text=True).stdout
                for row in json.loads(out)["rows"]:
                    results.setdefault((row["phase"], label), []).append(row["per_cpu_second"])
                    for name, value in row.get("us_per_span", {}).items():
                        results.setdefault((f"  {name} us/span", label), []).append(value)
                    print(f"round {round_no} {label:<14} {row['phase']:<11} {row['committed']:>9,.0f} committed/s "
                          f"{row['per_cpu_second']:>9,.0f} per CPU-s ({row['cpu_share']:.0%} of a core)", flush=True)
    print(f"\nmedian spans per CPU-second, load average now {os.getloadavg()[0]:.1f}")
    before, after = runs
    for phase in sorted({phase for phase, _ in results}, key=[p for p, _ in results].index):
        old, new = (statistics.median(results[(phase, label)]) for label in runs)
        print(f"{phase:<18} {before}: {old:>9,.2f}   {after}: {new:>9,.2f}   x{new / old:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each phase")
    parser.add_argument("--batch", type=int, default=512, help="spans per request")
    parser.add_argument("--senders", type=int, default=4, help="concurrent senders, sustained phase")
    parser.add_argument("--flood-senders", type=int, default=128, help="concurrent senders, flood phase")
    parser.add_argument("--flood-batch", type=int, default=1024,
                        help="spans per request, flood phase: with 512, 64 connections x 512 spans fit the "
                             "queue exactly, so senders wait instead of being refused and cannot offer 10x")
    parser.add_argument("--flood-processes", type=int, default=4, help="sender processes, flood phase")
    parser.add_argument("--max-queue-spans", type=int, default=32_768, help="SpanWriter queue bound")
    parser.add_argument("--phases", type=lambda text: [p for p in PHASES if p in text.split(",")],
                        default=list(PHASES), help=f"comma-separated, of {','.join(PHASES)}")
    parser.add_argument("--compare", metavar="REV", help="also run git revision REV's code, alternately")
    parser.add_argument("--compare-readers", action="store_true",
                        help="run the working tree with the Python and the compiled OTLP reader, alternately")
    parser.add_argument("--reader", choices=("python", "compiled"),
                        help="the OTLP byte reader (default: the compiled one where it was built)")
    parser.add_argument("--compare-builders", action="store_true",
                        help="run the working tree with the Python and the compiled span record builder, alternately")
    parser.add_argument("--builder", choices=("python", "compiled"),
                        help="the span record builder (default: the compiled one where it was built)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each tree with --compare")
    parser.add_argument("--gc-threshold", type=int, default=0, help="the receiver's first GC generation "
                        "threshold (default: Python's 700)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--otlp", choices=("http", "grpc"), default="http",
                        help="the protocol of the sustained and flood phases")
    parser.add_argument("--ordered-ids", action="store_true",
                        help="trace ids in counting order (one index page takes a body's spans), not random")
    parser.add_argument("--repeated-values", action="store_true",
                        help="every body with the template's ports, token counts and latencies (the reader's "
                             "cache of key-values then hits on them), not values drawn for each span")
    parser.add_argument("--from-container", action="store_true",
                        help=f"the in-process and stages phases' spans sent from a container's address ({FROM_CONTAINER})")
    parser.add_argument("--compare-senders", action="store_true",
                        help="run the working tree with spans from the loopback and from a container, alternately")
    parser.add_argument("--sender", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    global ORDERED_IDS, REPEATED_VALUES, SENDER
    ORDERED_IDS, REPEATED_VALUES = args.ordered_ids, args.repeated_values
    SENDER = FROM_CONTAINER if args.from_container else None
    if args.sender:
        print(json.dumps(run_senders(args.port, args.senders, args.seconds, args.batch, args.seed, args.otlp)))
    elif args.compare or args.compare_readers or args.compare_builders or args.compare_senders:
        compare(args)
    elif args.json:
        print(json.dumps(measure(args), indent=2))
    else:
        print_table(measure(args))


if __name__ == "__main__":
    main()
