#!/usr/bin/env bash
# OpenMP's wait policy on a shared machine: many small kernels (as a decode step runs them),
# 1 and 2 torch threads, GNU OpenMP's default policy (workers spin between kernels) and
# OMP_WAIT_POLICY=PASSIVE (they sleep), without and with one busy neighbour, alternating.
# The policy is read when torch loads OpenMP, so it is set in each process's environment.
#     bash scripts/wait_policy.sh [rounds]
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-.venv/bin/python}
WORK='
import time, torch
w1 = torch.randn(1536, 576); w2 = torch.randn(576, 1536); x = torch.randn(8, 576)
for _ in range(50): x = torch.tanh((x @ w1.T) @ w2.T * 1e-2)
s = time.perf_counter()
for _ in range(1500): x = torch.tanh((x @ w1.T) @ w2.T * 1e-2)
print(f"{torch.get_num_threads()} {time.perf_counter() - s:.3f}")
'
for round in $(seq 1 "${1:-3}"); do
  for nb in 0 1; do
    if [ "$nb" = 1 ]; then "$PY" -c 'while 1: pass' & NB=$!; sleep 1; fi
    for th in 1 2; do for pol in default PASSIVE; do
      if [ "$pol" = default ]; then r=$(OMP_NUM_THREADS=$th "$PY" -c "$WORK")
      else r=$(OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=$th "$PY" -c "$WORK"); fi
      echo "round=$round neighbour=$nb threads=$th policy=$pol seconds=${r#* } load=$(cut -d' ' -f1 /proc/loadavg)"
    done; done
    if [ "$nb" = 1 ]; then kill "$NB"; fi
  done
done
