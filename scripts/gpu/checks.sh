#!/usr/bin/env bash
# Correctness on a GPU box: devices, the fixtures against their references, TP parity.
#   bash scripts/gpu/checks.sh all        # devices, fixtures on one GPU, ring and NCCL TP, demo generate
#   bash scripts/gpu/checks.sh fixtures   # scripts/check_fixtures.py on one GPU
#   bash scripts/gpu/checks.sh parity     # tp-parity of the 8B bf16 checkpoint, TP=${TP:-2}
#   bash scripts/gpu/checks.sh host-fill  # tests/host_fill.rs on the GPU (HostFill, pinned masks): HOST_FILL_TEST=its test binary
#                                         # (here: `cargo test --release --test host_fill --no-run` prints
#                                         # its path; copy it beside the release binaries)
# Environment: see scripts/gpu/lib.sh.
. "$(dirname "$0")/lib.sh"
case "${1:-all}" in
all)
  step "nvidia-smi"; nvidia-smi --query-gpu=index,name,memory.used,memory.total,pci.bus_id --format=csv
  step "mlxcel devices"; $B devices
  step "mlxcel devices --check"; $B devices --check
  step "fixtures, one GPU"; python3 scripts/check_fixtures.py $B -n 12
  step "fixtures, --tp-size 2 --tp-emulate (ring, one GPU)"; python3 scripts/check_fixtures.py $B -n 12 --prompts 1 --tp-size 2 --tp-emulate
  step "fixtures, --tp-size 1 --tp-backend nccl"; python3 scripts/check_fixtures.py $B -n 12 --prompts 1 --tp-size 1 --tp-backend nccl
  if [ "$ngpu" -ge 2 ]; then
    step "fixtures, --tp-size 2 (NCCL)"; python3 scripts/check_fixtures.py $B -n 12 --prompts 1 --tp-size 2
    step "NCCL transport with per-rank CUDA_VISIBLE_DEVICES (NCCL_DEBUG=INFO)"
    NCCL_DEBUG=INFO $B generate -m demo --tp-size 2 -n 8 --ignore-eos 2>&1 | grep -E "NCCL INFO (Channel|Connected|.*via (P2P|SHM|NET))|P2P|SHM" | head -20
    step "--devices 1,0"; $B generate -m demo --tp-size 2 --devices 1,0 -n 4 --ignore-eos 2>&1 | grep -E "rank [01] \(pid"
  fi
  step "demo generate, one GPU"; $B generate -m demo -n 24
  ;;
fixtures)
  step "fixtures vs references, one GPU"
  timeout 200 python3 scripts/check_fixtures.py $B -n 12 2>&1 | tail -15 | tee "$OUT/fixtures.txt"
  ;;
host-fill)
  step "HostFill feeding a GPU op (what MLXCEL_DEFER_MASKS=1 needs)"
  timeout 60 "${HOST_FILL_TEST:-$(dirname "$B")/host_fill-test}" --nocapture 2>&1 | tail -8 | tee "$OUT/host-fill.txt"
  ;;
parity)
  ckpt
  step "tp-parity 8B bf16, 256 teacher-forced positions, TP=${TP:-2}"
  $B tp-parity -m "$CK/8b-bf16" --tp-size ${TP:-2} --steps 256 2>/dev/null | tee "$OUT/tp-parity.json"
  ;;
*) echo "unknown: $1 (all, fixtures, parity)" >&2; exit 2 ;;
esac
