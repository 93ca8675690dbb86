set -x
source .gpu-bundle/install.sh
export HYLO_BENCH_GIT_SHA=4e42752
nvidia-smi --query-gpu=name,memory.used --format=csv
mkdir -p $OUT
python3 benchmarks/decode_profile.py --contexts 65536 --variants merged-default+gemv+prestep --no-gemv-records --steps 64 --table $OUT/table64k.txt --out $OUT/dp.json 2>&1 | tail -5
timeout 330 python3 -m pytest -x -q tests/kernels/test_gemv.py tests/kernels/test_mla_decode.py -k "cuda" -p no:cacheprovider 2>&1 | tail -5
