#!/usr/bin/env bash
# The checks only a GPU host can run, in one go, each bounded in time; logs go to DIR.
# What they showed is recorded in docs/gpu-validation.md.
#
#   bench/gpu_check.sh [DIR]     (python3 with this project's requirements and PyTorch on CUDA)
#   LOAD_SECONDS=600 bench/gpu_check.sh   a longer load, to see whether the daemon's RSS levels off
#   EXPORT_DELAY_MS=5000 ALARMS=0 bench/gpu_check.sh   the detection load's spans at vLLM's 5 s cadence
#   MEMORY_PROBE=1 CHECKS=detection LOAD_SECONDS=420 EXPORT_DELAY_MS=5000 ALARMS=0 bench/gpu_check.sh
#       the daemon's memory by part each minute of the load (the 100 MiB goal's reading on a GPU host;
#       with CHECKS=probe, of the daemon on the prebuilt eBPF probe)
#   PROFILE=1 CHECKS=probe bench/gpu_check.sh   py-spy's stacks of the daemon on the eBPF source, in
#       DIR/profile-bpf.txt (where its CPU goes on a server core)
#   CHECKS="tests nvml poller" bench/gpu_check.sh   only those checks, of:
#       compiled tests nvml engine demo footprint poller probe detection alone   (all by default)
set -u
out=${1:-gpu-check}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

section() { echo; echo "=== $1 ($(date -u +%H:%M:%S))"; }
checks=" ${CHECKS:-compiled tests nvml engine demo footprint poller probe detection alone} "
wanted() { [[ $checks == *" $1 "* ]]; }

section "host"
nvidia-smi --query-gpu=name,driver_version,memory.total,utilization.gpu --format=csv 2>&1 | tee "$out/host.log"
"$py" -c "import sys, torch, pynvml; print(sys.version.split()[0], 'torch', torch.__version__,
'cuda', torch.cuda.is_available(), 'nvml', pynvml.__name__)" 2>&1 | tee -a "$out/host.log"

if wanted compiled; then
section "the compiled OTLP reader and span builder, built on this host, against the Python ones"
timeout 120 "$py" setup.py build_ext --inplace > "$out/build.log" 2>&1; tail -2 "$out/build.log"
timeout 300 "$py" -m pytest -q -p no:cacheprovider tests/test_otlp_wire_compiled.py tests/test_normalize_compiled.py \
    2>&1 | tee "$out/compiled-tests.log"
fi

if wanted tests; then
section "gpu-marked tests"
timeout 180 "$py" -m pytest -m gpu -rA -p no:cacheprovider tests/test_sampler_nvml.py 2>&1 | tee "$out/gpu-tests.log"
fi

if wanted nvml; then
section "what NVML costs, and its readings against CUDA events"
timeout 90 "$py" bench/nvml_cost.py 2>&1 | tee "$out/nvml-cost.log"
fi

if wanted engine; then
section "reference engine, cpu and cuda"
timeout 120 "$py" bench/engine.py 2>&1 | tee "$out/engine.log"
fi

if wanted demo; then
section "auditor demo --device cuda"
rm -rf "$out/demo"
timeout 240 "$py" -m auditor demo --device cuda -o "$out/demo" 2>&1 | tee "$out/demo.log"
fi

if wanted footprint; then
section "idle daemon, /proc source, NVML sampling this host's GPU"
timeout 90 "$py" bench/footprint.py --loaders procfs --seconds 30 --settle 5 --grpc 2>&1 | tee "$out/footprint.log"
fi

if wanted poller; then
section "the /proc poller's own CPU per poll"
timeout 150 "$py" bench/poller_cost.py --rounds 2 2>&1 | tee "$out/poller-cost.log"
fi

if wanted probe; then
# No bcc or kernel headers on these hosts: the probe as it ships (probes/disconnect.prebuilt.json)
# either loads on this kernel or says why, and then the same load as below runs on it.
section "the prebuilt eBPF probe on this kernel"
# Some GPU hosts' images leave tracefs unmounted (systemd mounts it at boot; the unit asks for it).
if [[ ! -d /sys/kernel/tracing/events && $(id -u) == 0 ]]; then
    echo "tracefs not mounted: mounting it"; mount -t tracefs nodev /sys/kernel/tracing
fi
COLUMNS=200 timeout 60 "$py" -m auditor doctor 2>&1 | tee "$out/doctor.log"
if grep -q "disconnect source: bpf, the prebuilt probe" "$out/doctor.log"; then
    load=${LOAD_SECONDS:-60}
    timeout $((load + 180)) "$py" bench/detection.py --source bpf --device cuda --alarms "${ALARMS:-10}" \
        --load-seconds "$load" --otlp grpc ${EXPORT_DELAY_MS:+--export-delay-ms "$EXPORT_DELAY_MS"} \
        ${MEMORY_PROBE:+--memory-probe} ${PROFILE:+--profile "$out/profile-bpf.txt" --profile-rate 100} 2>&1 \
        | tee "$out/detection-bpf.log"
fi
fi

if wanted detection; then
section "detection and load, /proc source, engines on cuda"
load=${LOAD_SECONDS:-60}
timeout $((load + 180)) "$py" bench/detection.py --source procfs --device cuda --alarms "${ALARMS:-10}" \
    --load-seconds "$load" --otlp grpc ${EXPORT_DELAY_MS:+--export-delay-ms "$EXPORT_DELAY_MS"} \
    ${MEMORY_PROBE:+--memory-probe} 2>&1 | tee "$out/detection.log"
fi
if wanted alone; then
# One engine on the GPU, as most hosts run: the daemon costs it by the whole GPU's utilization. The
# same load with per-process readings asked for, after it: the sampling thread's share side by side.
load=${LOAD_SECONDS:-60}
for always in false true; do
    section "one engine on the GPU, sampler.nvml_per_process_always=$always"
    AUDITOR_SAMPLER_NVML_PER_PROCESS_ALWAYS=$always timeout $((load + 120)) "$py" bench/detection.py --source procfs \
        --device cuda --load-engine-alone --alarms 0 --load-seconds "$load" --otlp grpc 2>&1 | tee "$out/alone-$always.log"
done
fi
section "done"
