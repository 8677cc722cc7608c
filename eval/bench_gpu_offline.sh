#!/bin/bash
# make bench-gpu on a lent GPU machine that reaches no network and holds no weights:
#   eval/bench_gpu_offline.sh prepare   here: transformers' wheel and Qwen2.5-0.5B's config and tokenizer (not its
#                                       weights) into .gpu/ (ignored by git; carry it to the machine)
#   eval/bench_gpu_offline.sh run [ARGS]  there, in the repository root: installs both offline (kvpress again when
#                                       its source changed), then bench_gpu with random weights of that architecture,
#                                       rows and log into $OUT (its gpu.jsonl begun from eval/results': resumed)
set -o pipefail
case "$1" in
prepare)
    python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 -d .gpu "transformers==$(python -c 'import transformers; print(transformers.__version__)')" || exit 1
    src=$(python -c 'import kvpress.models as m; print(m.resolve_model_path("qwen2.5-0.5b"))') || exit 1
    mkdir -p .gpu/qwen2.5-0.5b && find "$src" -maxdepth 1 -type f ! -name '*.safetensors' -exec cp {} .gpu/qwen2.5-0.5b/ \;
    grep -qx "/.gpu/" "$(git rev-parse --git-common-dir)/info/exclude" 2>/dev/null \
        || echo "/.gpu/" >> "$(git rev-parse --git-common-dir)/info/exclude"
    du -sh .gpu ;;
run)
    shift
    repo=$(pwd)
    mkdir -p "${OUT:?set OUT to the directory that comes back}"
    # resumed: the rows measured before (carried in eval/results) are not measured again on the same card
    [ -f "$OUT/gpu.jsonl" ] || cp eval/results/gpu.jsonl "$OUT/" 2>/dev/null
    if [ ! -d /tmp/site/transformers ]; then  # once a machine
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/*.whl || exit 1
    fi
    # kvpress again whenever its source changed (a warm machine otherwise runs the code installed before)
    stamp=$(find kvpress patches eval pyproject.toml -type f \( -name '*.py' -o -name '*.json' -o -name '*.toml' \) \
        ! -path 'eval/results/*' | sort | xargs cat | md5sum)
    if [ "$(cat /tmp/kv/.stamp 2>/dev/null)" != "$stamp" ]; then
        rm -rf /tmp/kv && python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/kv . || exit 1
        echo "$stamp" > /tmp/kv/.stamp
    fi
    export PYTHONPATH=/tmp/kv:/tmp/site PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    # outside the checkout: its kvpress/ would shadow the installed package (kvpress.eval lives in eval/); in a
    # directory of its own, not /tmp itself (`-m` puts the working directory first on sys.path: a module another
    # user left in /tmp would be imported)
    cd "$(mktemp -d)" && timeout "${BENCH_TIMEOUT:-400}" python3 -m kvpress.eval.bench_gpu --config "$repo/.gpu/qwen2.5-0.5b" \
        --out "$OUT" "$@" 2>&1 | tee -a "$OUT/log.txt" ;;
*)
    echo "usage: $0 prepare | run [bench_gpu arguments]" >&2; exit 2 ;;
esac
