"""Configuration precedence and validation: file, then AUDITOR_* variables, then flags."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from auditor.config import Config, load_config
from auditor.errors import ConfigError


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "auditor.toml"
    path.write_text(text)
    return path


def test_defaults_without_any_source() -> None:
    config = load_config(environ={})
    assert config.probe.ports == [8000]
    assert config.correlate.grace_seconds == 0.5
    assert config.otlp.http == "127.0.0.1:4318"


def test_file_then_environment_then_flags(tmp_path: Path) -> None:
    path = write(tmp_path, 'db = "sqlite:///file.db"\n[probe]\nports = [9000]\n[correlate]\ngrace_seconds = 2.0\n')
    env = {"AUDITOR_PROBE_PORTS": "9001,9002", "AUDITOR_DB": "sqlite:///env.db"}
    config = load_config(path, environ=env, overrides={"db": "sqlite:///flag.db"})
    assert config.db == "sqlite:///flag.db"
    assert config.probe.ports == [9001, 9002]
    assert config.correlate.grace_seconds == 2.0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[probe]\nprots = [1]\n", "unknown configuration key 'probe.prots'"),
        ("grace = 1\n", "unknown configuration key 'grace'"),
        ("[correlate]\ngrace_seconds = 'soon'\n", "correlate.grace_seconds = 'soon': expected a number"),
        ("[probe]\nports = [70000]\n", "probe.ports: 70000 is not a TCP port"),
        ("[probe]\nsource = 'magic'\n", "allowed are auto, bpf, procfs"),
        ("[otlp]\nhttp = 'localhost'\n", "otlp.http = 'localhost': expected HOST:PORT"),
        ("[otlp]\nhttp = 'localhost:\u00b2'\n", "otlp.http = 'localhost:\u00b2': expected HOST:PORT"),
        ("probe = 3\n", "probe must be a table"),
        ("[probe\n", "is not valid TOML"),
        ("[probe]\nring_buffer_mib = 3\n", "probe.ring_buffer_mib = 3: must be a power of two"),
        ("[probe]\nring_buffer_mib = 0\n", "probe.ring_buffer_mib = 0: must be a power of two"),
        ("[probe]\nring_buffer_mib = 2048\n", "probe.ring_buffer_mib = 2048: must be a power of two"),
    ],
)
def test_bad_file_names_the_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_config(write(tmp_path, text), environ={})


def test_bad_environment_names_the_variable() -> None:
    with pytest.raises(ConfigError, match=r"probe\.ports = 'eighty'"):
        load_config(environ={"AUDITOR_PROBE_PORTS": "eighty"})
    with pytest.raises(ConfigError, match="AUDITOR_GRACE is not a configuration key"):
        load_config(environ={"AUDITOR_GRACE": "1"})


@pytest.mark.parametrize(("name", "text", "key"), [
    ("AUDITOR_PROBE_PORTS", "\u0668\u0660\u0660\u0660", "probe.ports"),
    ("AUDITOR_CORRELATE_GRACE_SECONDS", "\u0661", "correlate.grace_seconds")])
def test_the_environment_takes_ascii_digits_only(name: str, text: str, key: str) -> None:
    """As --port does: int() and float() take Arabic-Indic digits, which nobody means as a setting."""
    with pytest.raises(ConfigError, match=f"{re.escape(key)} = '{text}': expected"):
        load_config(environ={name: text})


@pytest.mark.parametrize("text", ["nan", "+inf", "-inf"])
@pytest.mark.parametrize("key", ["correlate.grace_seconds", "correlate.interval_seconds", "probe.poll_hz",
                                 "retention.raw_hours", "retention.verdict_days", "retention.interval_seconds",
                                 "engine_metrics.interval_seconds", "correlate.late_span_seconds"])
def test_nan_and_infinity_are_refused_by_name(tmp_path: Path, key: str, text: str) -> None:
    """nan and inf are valid TOML floats and float() text, and slip past every < or > check."""
    section, name = key.split(".")
    with pytest.raises(ConfigError, match=rf"{re.escape(key)} = .*: expected a finite number"):
        load_config(write(tmp_path, f"[{section}]\n{name} = {text}\n"), environ={})
    with pytest.raises(ConfigError, match=rf"{re.escape(key)} = '{re.escape(text)}': expected a finite number"):
        load_config(environ={f"AUDITOR_{section.upper()}_{name.upper()}": text})
    with pytest.raises(ConfigError, match=rf"{re.escape(key)} = nan: expected a finite number"):
        config = Config()
        setattr(getattr(config, section), name, float("nan"))
        config.validate()


@pytest.mark.parametrize(("key", "value", "limit"), [
    ("correlate.grace_seconds", "1e300", "86400 (a day)"),
    ("correlate.interval_seconds", "1e300", "86400 (a day)"),
    ("correlate.late_span_seconds", "1e300", "86400 (a day)"),
    ("engine_metrics.interval_seconds", "1e300", "86400 (a day)"),
    ("retention.interval_seconds", "1e300", "86400 (a day)"),
    ("sampler.interval_ms", "99999999999999999", "8.64e+07 (a day)"),
    ("retention.raw_hours", "1e300", "876600 (100 years; 0 keeps them forever)"),
    ("retention.verdict_days", "1e300", "36525 (100 years; 0 keeps them forever)"),
])
def test_durations_longer_than_they_could_mean_are_refused_by_name(tmp_path: Path, key: str, value: str,
                                                                   limit: str) -> None:
    """Not an OverflowError later: the correlator's nanoseconds at start, every retention pass."""
    section, name = key.split(".")
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)} = .*: must be at most {re.escape(limit)}$"):
        load_config(write(tmp_path, f"[{section}]\n{name} = {value}\n"), environ={})


def test_late_span_seconds_below_zero_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"correlate\.late_span_seconds must be 0 or more"):
        load_config(write(tmp_path, "[correlate]\nlate_span_seconds = -1\n"), environ={})


@pytest.mark.parametrize("pid", [0, -1, 4194305, 99999999999])
def test_procfs_pids_outside_linux_pid_range_are_refused(tmp_path: Path, pid: int) -> None:
    """Not a warning from the sampler ten times a second for ever, nor silently nothing."""
    with pytest.raises(ConfigError, match=rf"sampler\.procfs_pids: {pid} is not a process id \(1-4194304"):
        load_config(write(tmp_path, f"[sampler]\nprocfs_pids = [{pid}]\n"), environ={})
    assert load_config(write(tmp_path, "[sampler]\nprocfs_pids = [1, 4194304]\n"),
                       environ={}).sampler.procfs_pids == [1, 4194304]


def test_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml", environ={})


def test_shipped_example_config_is_valid_and_holds_every_key_at_its_default() -> None:
    """docs/configuration.md points at it as "every key and its default"."""
    import dataclasses

    import tomllib

    from auditor.config import SECTIONS, Config

    example = Path(__file__).parents[1] / "systemd" / "auditor.toml"
    assert load_config(example, environ={}) == load_config(None, environ={})
    written = tomllib.loads(example.read_text())
    for section in SECTIONS:
        keys = {item.name for item in dataclasses.fields(getattr(Config(), section))}
        assert set(written.get(section, {})) == keys, section


def test_hosts_priced_apart_are_read_from_the_file_and_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "auditor.toml"
    path.write_text('[report]\ngpu_hour_price = 1.5\ncpu_hour_price = 0.04\n'
                    '[report.gpu_hour_prices]\n"gpu-h100-*" = 2.49\n"gpu-l4-7" = 0.8\n')
    report = load_config(path, environ={}).report
    assert report.gpu_hour_prices == {"gpu-h100-*": 2.49, "gpu-l4-7": 0.8}
    # What the daemon on each host exports as its own price (auditor_hour_price).
    assert report.hour_prices("gpu-h100-3") == (2.49, 0.04)
    assert report.hour_prices("gpu-l4-7") == (0.8, 0.04) and report.hour_prices("gpu-l4-70") == (1.5, 0.04)
    environ = {"AUDITOR_REPORT_CPU_HOUR_PRICES": "cpu-*=0.1, cpu-big=0.5"}
    assert load_config(path, environ=environ).report.cpu_hour_prices == {"cpu-*": 0.1, "cpu-big": 0.5}


@pytest.mark.parametrize(("text", "said"), [
    ('[report]\ngpu_hour_prices = 2.0\n', "report.gpu_hour_prices = 2.0: expected a table of host patterns"),
    ('[report.gpu_hour_prices]\n"a" = "cheap"\n', "report.gpu_hour_prices['a'] = 'cheap': expected a number"),
    ('[report.gpu_hour_prices]\n"a" = -1\n', "report.gpu_hour_prices['a'] = -1.0: a price cannot be negative"),
    ('[report.gpu_hour_prices]\n"a" = 1e9\n', "report.gpu_hour_prices['a'] = 1000000000.0: must be at most"),
    ('[report.gpu_hour_prices]\n"" = 1\n', "report.gpu_hour_prices: the host pattern '' must be 1 to 253"),
    ('[report.gpu_hour_prices]\n"a\\u0007" = 1\n', "the host pattern 'a\\x07' must be 1 to 253 printable"),
])
def test_a_bad_host_price_names_its_key_and_pattern(tmp_path: Path, text: str, said: str) -> None:
    path = tmp_path / "auditor.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_config(path, environ={})
    assert said in str(caught.value)
    with pytest.raises(ConfigError, match="expected a table of host patterns"):
        load_config(None, environ={"AUDITOR_REPORT_GPU_HOUR_PRICES": "gpu-a:2"})
