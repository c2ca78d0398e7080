#!/usr/bin/env bash
# Idempotent set-up for a Debian/Ubuntu host: OS packages (bcc, kernel headers, PostgreSQL for the
# fleet tests), tracefs, the virtual environment with bcc linked in, and the project itself.
# Fast when everything is already there: each step checks before it acts.
#
# What a target needs, from the environment (the Makefile sets them per target):
#   EXTRAS=dev|engine|...   the project's extras to install (default dev: tests, lint, engine, psycopg)
#   POSTGRES=1|0            install the PostgreSQL server for the fleet tests (default 1); the demo
#                           runs on SQLite and sets 0
set -euo pipefail

root_dir=$(cd "$(dirname "$0")/.." && pwd)
cd "$root_dir"
venv=${VENV:-.venv}
python=${PYTHON:-python3}
extras=${EXTRAS:-dev}
postgres=${POSTGRES:-1}
need_root=()

say() { printf 'setup: %s\n' "$*"; }

is_root() { [ "$(id -u)" -eq 0 ]; }

missing_packages() {
    local p
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || echo "$p"
    done
}

kernel_release=$(uname -r)
arch=$(dpkg --print-architecture 2>/dev/null || echo amd64)

# Kernel headers: the package for the running kernel when the distribution has one; otherwise
# distribution headers of bcc's era, linked in place (bcc reads tracepoint layouts from tracefs).
headers_package() {
    if apt-cache show "linux-headers-$kernel_release" >/dev/null 2>&1; then
        echo "linux-headers-$kernel_release"
    elif grep -qi '^ID=debian' /etc/os-release 2>/dev/null; then
        echo "linux-headers-cloud-$arch"
    else
        echo "linux-headers-generic"
    fi
}

if command -v apt-get >/dev/null 2>&1; then
    wanted=(python3-bpfcc bpfcc-tools)
    [ "$postgres" = 1 ] && wanted+=(postgresql)
    # The tests' independent HTTP/2 client (nghttp2) for the OTLP/gRPC receiver.
    [ "$extras" = dev ] && wanted+=(curl)
    # The tests' network namespaces (an engine in a container's own network): ip netns, veth.
    [ "$extras" = dev ] && wanted+=(iproute2)
    # Virtual machines on other kernels for the prebuilt probe's test (bench/probe_kernels.py).
    [ "$extras" = dev ] && [ "$arch" = amd64 ] && wanted+=(qemu-system-x86 busybox-static)
    # A C compiler and Python's headers build the compiled OTLP reader and record builder
    # (collectors/_otlp_wire.c, _normalize.c); without them the install still succeeds and bodies
    # are read, and records built, in Python.
    command -v cc >/dev/null 2>&1 || wanted+=(gcc libc6-dev)
    "$python" -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' 2>/dev/null \
        || wanted+=(python3-dev)
    have_headers=$( { [ -e "/lib/modules/$kernel_release/build" ] || ls -d /usr/src/linux-headers-*-"$arch" >/dev/null 2>&1; } && echo yes || true)
    missing=$(missing_packages "${wanted[@]}")
    if [ -n "$missing" ] || [ -z "$have_headers" ]; then
        if is_root; then
            say "installing OS packages"
            apt-get update -qq
            [ -z "$have_headers" ] && missing="$missing $(headers_package)"
            # shellcheck disable=SC2086
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
        else
            need_root+=("apt-get install $missing $([ -z "$have_headers" ] && headers_package)")
        fi
    fi
else
    say "no apt-get: install bcc (python3-bpfcc), kernel headers$([ "$postgres" = 1 ] && echo ' and PostgreSQL') with your package manager"
fi

# Link fallback headers when the running kernel has none of its own.
if [ ! -e "/lib/modules/$kernel_release/build" ]; then
    build=$(ls -d /usr/src/linux-headers-*-cloud-"$arch" /usr/src/linux-headers-*-"$arch" 2>/dev/null | sort -V | tail -1 || true)
    if [ -n "$build" ]; then
        common=${build%-cloud-"$arch"}
        common=${common%-"$arch"}-common
        if is_root; then
            mkdir -p "/lib/modules/$kernel_release"
            ln -sfn "$build" "/lib/modules/$kernel_release/build"
            [ -d "$common" ] && ln -sfn "$common" "/lib/modules/$kernel_release/source"
            say "linked kernel headers $build for $kernel_release"
        else
            need_root+=("ln -s $build /lib/modules/$kernel_release/build && ln -s $common /lib/modules/$kernel_release/source")
        fi
    fi
fi

# tracefs: bcc reads tracepoint formats from it.
if [ ! -e /sys/kernel/tracing/events ] && [ ! -e /sys/kernel/debug/tracing/events ]; then
    if is_root; then
        mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null || say "could not mount tracefs (eBPF probe will be unavailable)"
    else
        need_root+=("mount -t tracefs nodev /sys/kernel/tracing")
    fi
fi

# Virtual environment and the project, reinstalled when pyproject.toml or the set of top-level
# packages changed (an editable install maps the packages it saw when it was made), or when a
# target needs extras not installed yet. One stamp per extras set; dev includes engine.
if [ ! -x "$venv/bin/python" ]; then
    say "creating $venv"
    "$python" -m venv "$venv"
fi
hash=$( { cat pyproject.toml setup.py collectors/_*.c; ls -d -- */__init__.py; } | sha256sum | cut -c1-16)
stamp="$venv/.installed-$hash-$extras"
if [ ! -e "$stamp" ] && ! { [ "$extras" = engine ] && [ -e "$venv/.installed-$hash-dev" ]; }; then
    say "installing the project with extras [$extras]"
    "$venv/bin/python" -m pip install -q --upgrade pip
    # (the build backend warns of every editable install with an extension: not ours to act on)
    PYTHONWARNINGS=ignore "$venv/bin/python" -m pip install -q -e ".[$extras]"
    find "$venv" -maxdepth 1 -name '.installed-*' ! -name ".installed-$hash-*" -delete
    touch "$stamp"
fi

# Prometheus's promtool for the tests of the alert rules: the one binary, from Debian's package.
if [ "$extras" = dev ] && [ ! -x "$venv/bin/promtool" ] && command -v apt-get >/dev/null 2>&1; then
    scratch=$(mktemp -d)
    if (cd "$scratch" && apt-get download -qq prometheus 2>/dev/null) \
            && dpkg-deb --fsys-tarfile "$scratch"/prometheus_*.deb | tar -xO ./usr/bin/promtool > "$scratch/promtool"; then
        install -m 755 "$scratch/promtool" "$venv/bin/promtool"
    else
        say "could not fetch promtool (Debian's prometheus package): the alert rules' tests will skip"
    fi
    rm -rf "$scratch"
fi

# nginx for the tests behind a real proxy (tests/nginx.py): the one binary, from the distribution's
# package, not the package itself (whose install starts a web server on port 80).
if [ "$extras" = dev ] && [ ! -x "$venv/bin/nginx" ] && ! command -v nginx >/dev/null 2>&1 \
        && [ ! -x /usr/sbin/nginx ] && command -v apt-get >/dev/null 2>&1; then
    scratch=$(mktemp -d)
    for package in nginx nginx-core nginx-light; do
        if (cd "$scratch" && apt-get download -qq "$package" 2>/dev/null) \
                && dpkg-deb --fsys-tarfile "$scratch"/"$package"_*.deb | tar -xO ./usr/sbin/nginx > "$scratch/nginx" 2>/dev/null \
                && [ -s "$scratch/nginx" ]; then
            install -m 755 "$scratch/nginx" "$venv/bin/nginx"
            break
        fi
    done
    [ -x "$venv/bin/nginx" ] || say "could not fetch nginx (the distribution's nginx package): the tests behind nginx will skip"
    rm -rf "$scratch"
fi

if ! "$venv/bin/python" -c 'import collectors._otlp_wire, collectors._normalize' 2>/dev/null; then
    say "the compiled OTLP reader or record builder was not built (no C compiler or Python headers?): spans are read and built in slower Python"
fi

# bcc comes from the OS; make it importable from the venv.
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ -d /usr/lib/python3/dist-packages/bcc ] && [ ! -e "$site/bcc" ]; then
    ln -sfn /usr/lib/python3/dist-packages/bcc "$site/bcc"
fi

if [ ${#need_root[@]} -gt 0 ]; then
    say "not root: these steps were skipped; run them as root for the eBPF probe and the fleet tests:"
    for c in "${need_root[@]}"; do printf '  sudo %s\n' "$c"; done
fi
say "ready ($venv)"
