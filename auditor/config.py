"""Configuration: a TOML file, then ``AUDITOR_*`` environment variables, then command-line flags.

Later sources win. Every key is declared here with its type; an unknown key or a bad value is a
``ConfigError`` that names the key and what is allowed, so a typo never silently falls back.

Environment names are ``AUDITOR_<KEY>`` for top-level keys and ``AUDITOR_<SECTION>_<KEY>`` for keys
in a section, upper-cased: ``AUDITOR_DB``, ``AUDITOR_PROBE_PORTS=8000,8001``,
``AUDITOR_CORRELATE_GRACE_SECONDS=0.5``.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import mmap
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from auditor.errors import ConfigError


@dataclass
class ProbeConfig:
    ports: list[int] = field(default_factory=lambda: [8000])
    source: str = "auto"  # auto | bpf | procfs
    poll_hz: float = 20.0  # the unprivileged fallback's polling rate
    # The eBPF probe's ring buffer: kernel memory mapped into the daemon, so all of it counts in
    # its RSS. 1 MiB holds 16,384 events: 80 ms at 200,000 events/s, the reader woken before a
    # quarter of it fills.
    ring_buffer_mib: int = 1

    @property
    def ring_buffer_pages(self) -> int:
        return (self.ring_buffer_mib << 20) // mmap.PAGESIZE


@dataclass
class OtlpConfig:
    http: str = "127.0.0.1:4318"  # "" disables the receiver
    grpc: str = "127.0.0.1:4317"
    token: str = ""  # bearer token required of exporters when set
    max_body_bytes: int = 8 * 1024 * 1024


@dataclass
class SamplerConfig:
    interval_ms: int = 100
    nvml: bool = True
    # A GPU's only process is costed by the whole GPU's utilization (all of it is that process's),
    # without NVML's per-process call (1.4 ms of CPU); true asks per process for it too.
    nvml_per_process_always: bool = False
    procfs_pids: list[int] = field(default_factory=list)  # extra CPU-sampled pids; engines are found from spans


@dataclass
class CorrelateConfig:
    grace_seconds: float = 0.5
    interval_seconds: float = 1.0
    late_span_seconds: float = 60.0  # how long to wait for late or out-of-order spans


@dataclass
class EngineMetricsConfig:
    # Scrape each watched port's own /metrics (vLLM, SGLang, TGI, llama.cpp gauges): the evidence
    # that work stopped, or went on, when the engine emits no engine span.
    scrape: bool = True
    interval_seconds: float = 0.25
    path: str = "/metrics"


@dataclass
class SpansConfig:
    # Engine span names besides vLLM's llm_request (GenAI-convention inference spans are known by
    # their gen_ai.operation.name); a trailing * matches a prefix. CLIENT spans never count.
    engine_names: list[str] = field(default_factory=list)


@dataclass
class MetricsConfig:
    listen: str = "127.0.0.1:9464"  # "" disables /metrics


@dataclass
class LiveConfig:
    listen: str = "127.0.0.1:4319"  # UDP address for live span notices; "" disables live alarms


@dataclass
class ExportConfig:
    otlp_logs_endpoint: str = ""  # OTLP/HTTP logs URL for final verdicts, e.g. http://collector:4318/v1/logs

    def validate(self) -> None:
        if self.otlp_logs_endpoint and not self.otlp_logs_endpoint.startswith(("http://", "https://")):
            raise ConfigError(f"export.otlp_logs_endpoint = {self.otlp_logs_endpoint!r}: expected an http:// or "
                              "https:// URL, e.g. http://127.0.0.1:4318/v1/logs ('' turns it off)")


@dataclass
class RetentionConfig:
    raw_hours: float = 6.0  # spans, kernel events, utilization samples; 0 keeps them forever
    verdict_days: float = 30.0  # verdicts and coverage; 0 keeps them forever
    batch_rows: int = 5000  # rows per DELETE: how long ingest may wait on SQLite
    interval_seconds: float = 300.0

    def validate(self) -> None:
        if self.raw_hours < 0 or self.verdict_days < 0:
            raise ConfigError("retention.raw_hours and retention.verdict_days must be 0 (keep forever) or more")
        _at_most("retention.raw_hours", self.raw_hours, CENTURY_DAYS * 24, "100 years; 0 keeps them forever")
        _at_most("retention.verdict_days", self.verdict_days, CENTURY_DAYS, "100 years; 0 keeps them forever")
        if 0 < self.raw_hours < 1:
            # The correlator re-reads the last 15 minutes after a restart, and late spans reopen verdicts.
            raise ConfigError(f"retention.raw_hours = {self.raw_hours}: keep raw rows at least 1 hour (0: forever)")
        if self.verdict_days and self.raw_hours and self.verdict_days * 24 < self.raw_hours:
            raise ConfigError(f"retention.verdict_days = {self.verdict_days} is shorter than retention.raw_hours = "
                              f"{self.raw_hours}: findings must outlive the evidence they come from")
        _positive("retention.batch_rows", self.batch_rows)
        _positive("retention.interval_seconds", self.interval_seconds)
        _at_most("retention.interval_seconds", self.interval_seconds, DAY_SECONDS, "a day")


MAX_HOST_PATTERN = 253  # the longest host name DNS allows


def host_pattern(host: str | None, patterns: Iterable[str]) -> str | None:
    """The first of ``patterns`` (shell-style host name patterns) that ``host`` matches; None."""
    if host is None:
        return None
    return next((pattern for pattern in patterns if fnmatch.fnmatchcase(host, pattern)), None)


def host_price(host: str | None, patterns: Iterable[tuple[str, float]], otherwise: float) -> float:
    """The price the first of ``patterns`` (host name pattern, price) that ``host`` matches gives,
    else ``otherwise`` (also for no host named)."""
    prices = dict(patterns)
    matched = host_pattern(host, prices)
    return otherwise if matched is None else prices[matched]


def _check_price(key: str, price: float) -> None:
    if price < 0:
        raise ConfigError(f"{key} = {price}: a price cannot be negative (0 leaves it unpriced)")
    _at_most(key, price, MAX_HOUR_PRICE, "no hour costs more: is it in cents?")


@dataclass
class ReportConfig:
    # What an hour of one GPU, and of one CPU core, costs: the report prices the wasted time at these
    # (0: unpriced, the report shows seconds only), on the hosts the patterns below do not name.
    gpu_hour_price: float = 0.0
    cpu_hour_price: float = 0.0
    currency: str = "USD"  # the unit the prices are in, shown after each cost
    # Hosts priced apart (a fleet of several kinds): host name pattern (shell-style, gpu-h100-*) ->
    # its price, the first pattern a host matches in the order written; the prices above for the
    # hosts none names. In the environment: PATTERN=PRICE,PATTERN=PRICE.
    gpu_hour_prices: dict[str, float] = field(default_factory=dict)
    cpu_hour_prices: dict[str, float] = field(default_factory=dict)

    def validate(self) -> None:
        for key in ("gpu_hour_price", "cpu_hour_price"):
            _check_price(f"report.{key}", getattr(self, key))
        for key in ("gpu_hour_prices", "cpu_hour_prices"):
            for pattern, price in getattr(self, key).items():
                if not 1 <= len(pattern) <= MAX_HOST_PATTERN or not pattern.isprintable():
                    raise ConfigError(f"report.{key}: the host pattern {pattern!r} must be 1 to {MAX_HOST_PATTERN} "
                                      "printable characters, e.g. gpu-h100-* or a whole host name")
                _check_price(f"report.{key}[{pattern!r}]", price)
        text = self.currency
        if not 1 <= len(text) <= 8 or not text.isprintable() or any(c.isspace() for c in text):
            raise ConfigError(f"report.currency = {text!r}: expected a short unit without spaces, e.g. USD, EUR or $")

    def hour_prices(self, host: str) -> tuple[float, float]:
        """(GPU-hour, CPU-hour) prices of ``host``: its pattern's, else the prices of the rest."""
        return (host_price(host, self.gpu_hour_prices.items(), self.gpu_hour_price),
                host_price(host, self.cpu_hour_prices.items(), self.cpu_hour_price))


@dataclass
class Config:
    db: str = ""  # empty: SQLite in the state directory
    host_id: str = ""  # empty: the host name
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    otlp: OtlpConfig = field(default_factory=OtlpConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    correlate: CorrelateConfig = field(default_factory=CorrelateConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    live: LiveConfig = field(default_factory=LiveConfig)
    engine_metrics: EngineMetricsConfig = field(default_factory=EngineMetricsConfig)
    spans: SpansConfig = field(default_factory=SpansConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    report: ReportConfig = field(default_factory=ReportConfig)

    def validate(self) -> None:
        for section in SECTIONS:
            for item in dataclasses.fields(getattr(self, section)):
                _finite(f"{section}.{item.name}", getattr(getattr(self, section), item.name))
        if self.probe.source not in ("auto", "bpf", "procfs"):
            raise ConfigError(f"probe.source = {self.probe.source!r}: allowed are auto, bpf, procfs")
        for port in self.probe.ports:
            if not 1 <= port <= 65535:
                raise ConfigError(f"probe.ports: {port} is not a TCP port (1-65535)")
        _positive("probe.poll_hz", self.probe.poll_hz)
        mib = self.probe.ring_buffer_mib
        if isinstance(mib, bool) or not isinstance(mib, int) or not 1 <= mib <= 1024 or mib & (mib - 1):
            raise ConfigError(f"probe.ring_buffer_mib = {mib!r}: must be a power of two from 1 to 1024 "
                              "(the kernel's ring buffers are a power of two pages)")
        _positive("sampler.interval_ms", self.sampler.interval_ms)
        _at_most("sampler.interval_ms", self.sampler.interval_ms, DAY_SECONDS * 1000, "a day")
        for pid in self.sampler.procfs_pids:
            if not 1 <= pid <= PID_MAX:
                raise ConfigError(f"sampler.procfs_pids: {pid} is not a process id (1-{PID_MAX}, Linux's "
                                  "largest pid_max); list the pids of running processes, e.g. [1234]")
        _positive("correlate.interval_seconds", self.correlate.interval_seconds)
        _at_most("correlate.interval_seconds", self.correlate.interval_seconds, DAY_SECONDS, "a day")
        _positive("engine_metrics.interval_seconds", self.engine_metrics.interval_seconds)
        _at_most("engine_metrics.interval_seconds", self.engine_metrics.interval_seconds, DAY_SECONDS, "a day")
        if not self.engine_metrics.path.startswith("/"):
            raise ConfigError(f"engine_metrics.path = {self.engine_metrics.path!r}: must start with /")
        if self.correlate.grace_seconds < 0:
            raise ConfigError("correlate.grace_seconds must be 0 or more")
        _at_most("correlate.grace_seconds", self.correlate.grace_seconds, DAY_SECONDS, "a day")
        if self.correlate.late_span_seconds < 0:
            raise ConfigError("correlate.late_span_seconds must be 0 or more")
        _at_most("correlate.late_span_seconds", self.correlate.late_span_seconds, DAY_SECONDS, "a day")
        _positive("otlp.max_body_bytes", self.otlp.max_body_bytes)
        for key, addr in (("otlp.http", self.otlp.http), ("otlp.grpc", self.otlp.grpc),
                          ("metrics.listen", self.metrics.listen), ("live.listen", self.live.listen)):
            if addr:
                parse_address(addr, key)
        self.retention.validate()
        self.export.validate()
        self.report.validate()


def _finite(key: str, value: Any) -> None:
    """Refuse nan and inf, which every comparison lets through or gets wrong."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key} = {value}: expected a finite number, e.g. 0.5")


DAY_SECONDS = 86_400
CENTURY_DAYS = 36_525
MAX_HOUR_PRICE = 100_000.0  # no hour of one GPU or core costs more
PID_MAX = 4_194_304  # the kernel's PID_MAX_LIMIT: no pid_max is larger


def _at_most(key: str, value: float, limit: float, meaning: str) -> None:
    """Refuse a duration longer than anything it could mean: one too large for the nanoseconds and
    timers it becomes would fail later, in the daemon, rather than here."""
    if value > limit:
        raise ConfigError(f"{key} = {value}: must be at most {limit:g} ({meaning})")


def _positive(key: str, value: float) -> None:
    _finite(key, value)
    if value <= 0:
        raise ConfigError(f"{key} must be greater than 0 (got {value})")


def parse_address(text: str, key: str = "address") -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 as ``[::1]:PORT``) into its parts, or a ConfigError naming ``key``."""
    host, sep, port_text = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not (port_text.isascii() and port_text.isdigit()) or not 0 <= int(port_text) <= 65535:
        raise ConfigError(f"{key} = {text!r}: expected HOST:PORT, e.g. 127.0.0.1:4318")
    return host, int(port_text)


def loopback_only(addresses: Iterable[str]) -> bool:
    """Whether every listener address set (``HOST:PORT``; ``""`` is off) is on the loopback, where a
    container on a network of its own cannot send (its 127.0.0.1 is its own)."""
    hosts = [address.rpartition(":")[0].strip("[]") for address in addresses if address]
    return bool(hosts) and all(host in ("localhost", "::1") or host.startswith("127.") for host in hosts)


SECTIONS: dict[str, type] = {
    "probe": ProbeConfig, "otlp": OtlpConfig, "sampler": SamplerConfig,
    "correlate": CorrelateConfig, "metrics": MetricsConfig, "live": LiveConfig,
    "engine_metrics": EngineMetricsConfig, "spans": SpansConfig,
    "retention": RetentionConfig, "export": ExportConfig, "report": ReportConfig,
}


def _coerce(key: str, kind: Any, value: Any, *, from_text: bool) -> Any:
    """Turn a TOML or environment value into the declared type, or fail naming the key."""
    try:
        if kind is bool:
            if from_text:
                lowered = str(value).strip().lower()
                if lowered in ("1", "true", "yes", "on"):
                    return True
                if lowered in ("0", "false", "no", "off"):
                    return False
                raise ValueError
            if isinstance(value, bool):
                return value
            raise ValueError
        if kind is int:
            if isinstance(value, bool) or (not from_text and not isinstance(value, int)):
                raise ValueError
            if from_text and not str(value).isascii():  # int() takes "٨٠٠٠"; --port does not
                raise ValueError
            return int(value)
        if kind is float:
            if isinstance(value, bool) or (not from_text and not isinstance(value, (int, float))):
                raise ValueError
            if from_text and not str(value).isascii():
                raise ValueError
            number = float(value)
            if not math.isfinite(number):  # nan, inf: valid TOML and float() text, never a setting
                raise ConfigError(f"{key} = {value!r}: expected a finite number, e.g. 0.5")
            return number
        if kind is str:
            if not from_text and not isinstance(value, str):
                raise ValueError
            return str(value)
        if kind == list[str]:
            items = [v.strip() for v in str(value).split(",") if v.strip()] if from_text else value
            if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
                raise ValueError
            return list(items)
        if kind == dict[str, float]:
            if from_text:
                pairs = [item.rpartition("=") for item in str(value).split(",") if item.strip()]
                if any(not sep or not name.strip() for name, sep, _ in pairs):
                    raise ValueError
                value = {name.strip(): number.strip() for name, _, number in pairs}
            if not isinstance(value, Mapping) or not all(isinstance(name, str) for name in value):
                raise ValueError
            return {name: _coerce(f"{key}[{name!r}]", float, number, from_text=from_text)
                    for name, number in value.items()}
        if kind == list[int]:
            items = [v for v in str(value).split(",") if v.strip()] if from_text else value
            if not isinstance(items, list):
                raise ValueError
            return [_coerce(key, int, v, from_text=from_text) for v in items]
    except (TypeError, ValueError):
        pass
    else:
        raise AssertionError(f"config type {kind} of {key} is not handled")
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    lists = "a list of strings" if kind == list[str] else "a list of integers"
    allowed = names.get(kind, f"{lists} (comma-separated in the environment)")
    if kind == dict[str, float]:
        allowed = "a table of host patterns and their prices (PATTERN=PRICE,... in the environment)"
    raise ConfigError(f"{key} = {value!r}: expected {allowed}")


def _apply(target: Any, values: Mapping[str, Any], prefix: str, *, from_text: bool) -> None:
    hints = get_type_hints(type(target))
    known = {f.name for f in dataclasses.fields(target)}
    for name, value in values.items():
        key = f"{prefix}{name}"
        if name not in known:
            raise ConfigError(f"unknown configuration key {key!r}; known keys: "
                              + ", ".join(f"{prefix}{k}" for k in sorted(known)))
        if name in SECTIONS and not prefix:
            if not isinstance(value, Mapping):
                raise ConfigError(f"{key} must be a table ([{key}])")
            _apply(getattr(target, name), value, f"{name}.", from_text=from_text)
        else:
            setattr(target, name, _coerce(key, hints[name], value, from_text=from_text))


def _environment(environ: Mapping[str, str]) -> dict[str, Any]:
    """``AUDITOR_*`` variables as a nested mapping; unknown names are errors like unknown keys."""
    result: dict[str, Any] = {}
    top_level = {f.name for f in dataclasses.fields(Config)} - set(SECTIONS)
    for name, value in environ.items():
        if not name.startswith("AUDITOR_") or name in _NOT_CONFIG:
            continue
        rest = name[len("AUDITOR_"):].lower()
        if rest in top_level:
            result[rest] = value
            continue
        # The longest section that prefixes the name: engine_metrics before a section "engine".
        section = max((s for s in SECTIONS if rest.startswith(f"{s}_")), key=len, default="")
        key = rest[len(section) + 1:] if section else ""
        if section and key:
            result.setdefault(section, {})[key] = value
        else:
            raise ConfigError(f"environment variable {name} is not a configuration key; "
                              "use AUDITOR_<KEY> or AUDITOR_<SECTION>_<KEY>, e.g. AUDITOR_PROBE_PORTS")
    return result


# Variables in the AUDITOR_ namespace that steer tests and tooling, not the daemon.
_NOT_CONFIG = {"AUDITOR_REQUIRE_PRIVILEGED", "AUDITOR_CONFIG"}


def load_config(path: str | os.PathLike[str] | None = None, *,
                environ: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> Config:
    """Build the configuration from file, environment and flags (``overrides`` use dotted keys)."""
    config = Config()
    environ = os.environ if environ is None else environ
    path = path or environ.get("AUDITOR_CONFIG")
    if path:
        file = Path(path)
        try:
            data = tomllib.loads(file.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {file} does not exist") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read config file {file}: {exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {file} is not valid TOML: {exc}") from None
        _apply(config, data, "", from_text=False)
    _apply(config, _environment(environ), "", from_text=True)
    return apply_overrides(config, overrides or {})


def apply_overrides(config: Config, overrides: Mapping[str, Any]) -> Config:
    """Apply command-line values (dotted keys, None = not given) and validate the result."""
    for dotted, value in overrides.items():
        if value is None:
            continue
        section, _, key = dotted.rpartition(".")
        nested: dict[str, Any] = {key: value} if not section else {section: {key: value}}
        _apply(config, nested, "", from_text=False)
    config.validate()
    return config
