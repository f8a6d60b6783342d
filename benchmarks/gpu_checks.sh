#!/usr/bin/env bash
# The checks and figures that need a machine with a CUDA GPU (CI has none), in two parts that
# each fit in a few minutes on one H100 with 16 cores. Run from the repository root, with the
# package importable (an install, or PYTHONPATH=src):
#
#   benchmarks/gpu_checks.sh cuda  OUT_DIR   # CUDA tests: the reader pool's pinned buffers and
#                                            # side streams, from_pretrained + bf16 mixed precision
#                                            # on NCCL (gpu_pretrained_check.py), then bench_gpu at Qwen3-30B-A3B's
#                                            # expert shape (~4.9 GiB): safetensors, transformers,
#                                            # moeshard.load with 1, 4, 8 reader threads, O_DIRECT,
#                                            # InstantTensor (buffered, direct I/O), fastsafetensors
#   benchmarks/gpu_checks.sh cpu16 OUT_DIR   # multi-rank CPU figures on a quiet many-core host
#                                            # (a core per rank): bench_load at 1 GiB (the planning
#                                            # share of a load), bench_quant (MXFP4 and INT4 loads
#                                            # against bf16, 4 ranks), bench_load's fresh-memory rows at 4
#                                            # and 8 ranks against transformers' own EP loader and the
#                                            # parallel read floor (warm and cold), moeshard bench
#                                            # reshard (cold), moeshard bench relocate
#   benchmarks/gpu_checks.sh lent  OUT_DIR   # both parts on a lent machine in under ~8 minutes
#                                            # (cuda <= 320 s, then cpu16 in what is left of 470 s):
#                                            # first installs the wheels under .whl/ (if any) to
#                                            # /tmp/site; OUT_DIR gets sys.txt, bench_gpu.txt and
#                                            # .json, and all.tgz (every log and JSON)
#
# Each writes its log and JSON under OUT_DIR. A failing step is noted in its log, the part goes on,
# and the part exits non-zero at the end.
#
# The public loaders bench_gpu compares (InstantTensor, fastsafetensors) are not dependencies;
# their rows are skipped with a note where they are missing. Their one runtime need is torch, so
# on a GPU host install them without their requirements, keeping the host's CUDA build of torch:
#   pip install --no-deps instanttensor==0.2.2 fastsafetensors==0.5.0
# For a machine that cannot reach the package index, fetch them here as wheels for its Python
# (3.12 below; transformers 5.24 and the regex it checks for, where the host has older ones):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#     instanttensor==0.2.2 fastsafetensors==0.5.0 transformers==5.24.0 regex==2026.11.19
set -euo pipefail
rc=0
what=${1:?usage: gpu_checks.sh cuda|cpu16|lent OUT_DIR}
out=${2:?usage: gpu_checks.sh cuda|cpu16|lent OUT_DIR}
mkdir -p "$out"
if [ "$what" = lent ]; then
  # Past timeouts the parts are killed; what they wrote so far is still packed.
  if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  { date; nvidia-smi; nproc; free -g; df -h /tmp .; uname -a
    python3 -c 'import importlib.metadata as m, sys
print(sys.version)
for p in ("torch", "transformers", "safetensors", "numpy", "instanttensor", "fastsafetensors"):
    try: print(p, m.version(p))
    except m.PackageNotFoundError: print(p, "not installed")'; } 2>&1 | tee "$out/sys.txt" || true
  mkdir -p /tmp/gpu_checks
  start=$SECONDS
  timeout -k 5 320 bash "$0" cuda /tmp/gpu_checks/cuda || { rc=$?; echo "[gpu_checks] cuda part exit $rc"; }
  echo "[gpu_checks] cuda part done at $((SECONDS - start)) s"
  timeout -k 5 $((470 - (SECONDS - start))) bash "$0" cpu16 /tmp/gpu_checks/cpu16 || { rc=$?; echo "[gpu_checks] cpu16 part exit $rc"; }
  echo "[gpu_checks] cpu16 part done at $((SECONDS - start)) s"
  cp /tmp/gpu_checks/cuda/bench_gpu.txt /tmp/gpu_checks/cuda/bench_gpu.json "$out/" 2>/dev/null || true
  tar czf "$out/all.tgz" --exclude=relocate_ckpt -C /tmp gpu_checks
  exit $rc
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="src:.${PYTHONPATH:+:$PYTHONPATH}"
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__,
"cuda", torch.cuda.is_available())' | tee "$out/versions.txt"
case "$what" in
  cuda)
    # A failing test must not cost the figures: note it, run bench_gpu, fail the part at the end.
    python3 -m pytest -q -p no:cacheprovider tests/test_readpool.py tests/test_load_local.py tests/test_bench_gpu.py 2>&1 | tee "$out/tests.txt" \
      || { rc=$?; echo "[gpu_checks] tests failed (exit $rc)" | tee -a "$out/tests.txt"; }
    python3 benchmarks/gpu_pretrained_check.py 2>&1 | tee "$out/pretrained.txt" \
      || { rc=$?; echo "[gpu_checks] from_pretrained check failed (exit $rc)" | tee -a "$out/pretrained.txt"; }
    python3 -m benchmarks.bench_gpu --threads 1,4,8 --direct-io --repeat 3 --out "$out" --cache /tmp/moeshard-gpu-ckpt 2>&1 | tee "$out/bench_gpu.txt"
    ;;
  cpu16)
    # bench_load first: its planning share is a target; bench relocate's figures have none.
    python3 -m benchmarks.bench_load --size-mib 1024 --repeat 3 --strategies shared,node,single \
      --no-negative-control --out "$out/bench_load.json" 2>&1 | tee "$out/bench_load.txt" \
      || { rc=$?; echo "[gpu_checks] bench_load failed (exit $rc)" | tee -a "$out/bench_load.txt"; }
    # Quantized checkpoints (MXFP4, INT4) dequantized on load against their bf16 twins, 4 ranks, A B A B.
    python3 -m benchmarks.bench_quant --size-mib 256 --repeat 3 --cache /tmp/moeshard-quant-ckpt \
      --out "$out/bench_quant.json" 2>&1 | tee "$out/bench_quant.txt" \
      || { rc=$?; echo "[gpu_checks] bench_quant failed (exit $rc)" | tee -a "$out/bench_quant.txt"; }
    # Loads at the read floor: whole loads in fresh memory, a core per rank.
    for ranks in 4 8; do
      python3 -m benchmarks.bench_load --size-mib 512 --ranks "$ranks" --ranks-per-node 4 --layouts "${ranks}x1" \
        --strategies moeshard-fresh,transformers-native,parallel-read-floor --repeat 5 --cache warm,cold \
        --out "$out/bench_load_fresh_$ranks.json" 2>&1 | tee "$out/bench_load_fresh_$ranks.txt" \
        || { rc=$?; echo "[gpu_checks] bench_load fresh $ranks failed (exit $rc)" | tee -a "$out/bench_load_fresh_$ranks.txt"; }
    done
    # Recovery after a lost node: reshard from live peers against a cold reload.
    for run in "full 4 2" "partial 4 2" "full 8 4"; do
      set -- $run
      python3 -m moeshard.cli bench reshard --hidden 512 --layers 4 --experts 16 --repeat 5 --cache cold,warm \
        --placement "$1" --world "$2" --local-world "$3" --out "$out/bench_reshard_$1_$2.json" 2>&1 \
        | tee "$out/bench_reshard_$1_$2.txt" \
        || { rc=$?; echo "[gpu_checks] bench reshard failed (exit $rc)" | tee -a "$out/bench_reshard_$1_$2.txt"; }
    done
    # Its checkpoint (~1.1 GiB) goes to $out/relocate_ckpt: leave that out of what you keep.
    python3 -m moeshard.cli bench relocate --out "$out" 2>&1 | tee "$out/bench_relocate.txt"
    ;;
  *)
    echo "unknown part $what (cuda, cpu16 or lent)" >&2
    exit 2
    ;;
esac
exit $rc
