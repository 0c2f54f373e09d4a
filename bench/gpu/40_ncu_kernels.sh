#!/usr/bin/env bash
# Issue 9: where the decode step's large launches lose bandwidth. Nsight Compute on one token's
# gdn_in GEMV (1.4 TB/s), the experts' gate/up and per-pair down launches (0.9 TB/s) and the LM head,
# Q4_0 at the 35B shapes with the tile table's tiles (bench/ncu_kernels.py): memory throughput
# against the ceiling, warp stall reasons, occupancy. The report is copied to $OUT and printed as CSV.
# ncu reads the counters on the Firecracker runtime only (the device library's KINDS.md); the first
# command says whether it can here.
source "$(dirname "$0")/env.sh"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || true)
[ -n "$NCU" ] || { echo "no ncu on this machine"; exit 0; }
"$NCU" --version | tail -1
timeout ${NCU_S:-300} "$NCU" --clock-control none --target-processes all \
  -k regex:"${KERNELS:-_gemv_kernel|_moe_gate_up_kernel|_moe_down_pairs_kernel}" \
  --launch-skip ${SKIP:-0} --launch-count ${COUNT:-20} \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
  --section Occupancy --section LaunchStats -o "$OUT/decode_kernels" -f \
  python3 bench/ncu_kernels.py --shapes ${SHAPES:-gdn_in,experts,lm_head} --calls ${CALLS:-4} \
  > "$OUT/ncu.log" 2>&1 || echo "ncu rc=$?"
tail -20 "$OUT/ncu.log" | grep -v "^==PROF==" || true
[ -f "$OUT/decode_kernels.ncu-rep" ] || exit 0
"$NCU" --import "$OUT/decode_kernels.ncu-rep" --page details --csv > "$OUT/ncu_details.csv" 2>&1 || true
"$NCU" --import "$OUT/decode_kernels.ncu-rep" --page details --print-units base 2>/dev/null \
  | grep -E "_kernel|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Stall|Registers Per|Block Size|Grid Size" \
  | head -120 || true
