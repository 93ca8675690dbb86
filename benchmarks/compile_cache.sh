#!/usr/bin/env bash
# Carry Triton's and Inductor's on-disk compile caches from one GPU machine to the next fresh one.
#
# A fresh machine compiles every Triton kernel the benchmarks launch (fla's GDN kernels over all their autotune
# configs, our GEMV / MLA / GDN kernels): about 145-185 s before a 64K prompt's first prefill. Triton keys each
# compiled kernel by its source, the Triton version and the target (sm_90 for both H100 and H200), so a cache made on
# one machine of the same image is valid on the next; a kernel it lacks is compiled as usual. Triton's cache records
# absolute paths, so it is restored to the same place ($TRITON_CACHE_DIR, default ~/.triton/cache).
#
#   benchmarks/compile_cache.sh save OUTDIR     on the device, after a run: OUTDIR/compile-cache.tar.xz.NN, parts of
#                                               15 MiB (the device returns files of at most 16 MiB)
#   benchmarks/compile_cache.sh restore DIR     on the device, before a run: unpack DIR/compile-cache.tar.xz.* (if any)
#
# Between machines the parts live in an ignored folder of the checkout (e.g. .compile-cache/, named in `carry`).
set -euo pipefail

triton_dir="${TRITON_CACHE_DIR:-$HOME/.triton/cache}"
inductor_dir="${TORCHINDUCTOR_CACHE_DIR:-/tmp/torchinductor_$(id -un)}"

case "${1:-}" in
save)
    out="${2:?usage: $0 save OUTDIR}"
    mkdir -p "$out"
    paths=()
    for d in "$triton_dir" "$inductor_dir"; do
        [ -d "$d" ] && paths+=("$d")
    done
    if [ ${#paths[@]} -eq 0 ]; then
        echo "compile_cache: no cache at $triton_dir or $inductor_dir; nothing saved" >&2
        exit 0
    fi
    rm -f "$out"/compile-cache.tar.xz.*
    tar -cf - --absolute-names "${paths[@]}" | xz -T0 -6 | split -b 15M -d - "$out/compile-cache.tar.xz."
    du -ch "$out"/compile-cache.tar.xz.* | tail -1
    ;;
restore)
    dir="${2:?usage: $0 restore DIR}"
    parts=("$dir"/compile-cache.tar.xz.*)
    if [ ! -e "${parts[0]}" ]; then
        echo "compile_cache: no parts in $dir; kernels compile as usual" >&2
        exit 0
    fi
    cat "${parts[@]}" | xz -d | tar -xf - --absolute-names
    echo "compile_cache: restored $(find "$triton_dir" -name '*.cubin' 2>/dev/null | wc -l) Triton kernels"
    ;;
*)
    echo "usage: $0 save OUTDIR | restore DIR" >&2
    exit 2
    ;;
esac
