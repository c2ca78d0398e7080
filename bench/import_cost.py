"""What an import costs a process's RSS: each group of modules imported in a fresh interpreter after
the same base of standard modules the daemon loads anyway, side by side.

    .venv/bin/python bench/import_cost.py [--group NAME=mod1,mod2 ...] [--rounds 3]

The default groups are the ones the daemon stopped importing (docs/footprint.md, forty-fourth
and forty-sixth passes), the two modules that replaced the first ones, and the OTLP receivers as
the daemon imports them now. Figures are medians of ``--rounds`` interpreters;
resident pages of shared libraries count as the kernel counts them in RSS.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

BASE = "socket, threading, re, json, zlib, sqlite3, ctypes, tomllib, logging, dataclasses, collections, struct, select"
GROUPS = {
    "http.server": "http.server",
    "ssl": "ssl",
    "hashlib": "hashlib",
    "hmac": "hmac",
    "prometheus_client": "prometheus_client",
    "all the above": "http.server, urllib.request, wsgiref.simple_server, prometheus_client, hmac",
    "auditor.http1 + promtext": "auditor.http1, auditor.promtext",
    "protobuf + OTLP messages": "google.protobuf.json_format, google.rpc.status_pb2, "
                                "opentelemetry.proto.collector.trace.v1.trace_service_pb2, "
                                "opentelemetry.proto.collector.metrics.v1.metrics_service_pb2, "
                                "opentelemetry.proto.collector.logs.v1.logs_service_pb2",
    "the daemon": "auditor.daemon",
    "the daemon + OTLP receivers": "auditor.daemon, collectors.otlp_http, collectors.otlp_grpc, collectors.spanwriter",
}

PROBE = r"""
import gc, json, sys
import {base}
before = set(sys.modules)
{imports}
gc.collect()
fields = {{}}
for line in open("/proc/self/status"):
    name, _, value = line.partition(":")
    if name in ("VmRSS", "RssAnon", "RssFile"):
        fields[name] = int(value.split()[0]) / 1024
fields["modules"] = len(set(sys.modules) - before)
fields["ssl"] = "ssl" in sys.modules
print(json.dumps(fields))
"""


def measure(modules: str) -> dict[str, float]:
    imports = f"import {modules}" if modules else ""
    done = subprocess.run([sys.executable, "-c", PROBE.format(base=BASE, imports=imports)], capture_output=True,
                          text=True, check=True, timeout=120)
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--group", action="append", default=[], metavar="NAME=mod1,mod2",
                        help="a group of modules to measure (replaces the default groups)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    groups = dict(group.split("=", 1) for group in args.group) if args.group else GROUPS
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    rows = {"(base)": ""} | groups
    results = {name: [measure(modules) for _ in range(args.rounds)] for name, modules in rows.items()}
    base = {key: statistics.median(r[key] for r in results["(base)"]) for key in ("VmRSS", "RssAnon", "RssFile")}
    print(f"RSS over a base of standard modules ({base['VmRSS']:.1f} MiB), MiB, medians of {args.rounds}")
    print(f"  {'group':<28}{'RSS':>8}{'anon':>8}{'file':>8}{'modules':>9}  ssl")
    for name, runs in results.items():
        if name == "(base)":
            continue
        median = {key: statistics.median(r[key] for r in runs) - base[key] for key in base}
        print(f"  {name:<28}{median['VmRSS']:>8.1f}{median['RssAnon']:>8.1f}{median['RssFile']:>8.1f}"
              f"{runs[0]['modules']:>9}  {'yes' if runs[0]['ssl'] else 'no'}")


if __name__ == "__main__":
    main()
