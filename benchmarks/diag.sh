#!/usr/bin/env bash
# One-off GPU diagnosis (run 2026-12-04 on an H200, as .diag/diag.sh; its results are
# benchmarks/results/2026-12-04-h200-diag*): the segfault on ValueError, the gpu tests by name, the
# bench sections. Run beside benchmarks/device_check.sh: OUT=<folder> bash benchmarks/diag.sh
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TQDM_DISABLE=1 MPLBACKEND=Agg
ROOT=$PWD
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-packages .whl/*.whl
export PYTHONPATH=$ROOT:/tmp/site-packages
{
  el env
  which -a g++ c++ gcc; g++ --version | head -1; /usr/bin/g++ --version 2>&1 | head -1; ls /opt/gcc/bin | head -20
  echo | g++ -dM -E -x c++ - | grep -E "GXX_ABI_VERSION|__GNUC__ |__GNUC_MINOR__"
  echo '#include <string>' | g++ -dM -E -x c++ - | grep -E "_GLIBCXX_USE_CXX11_ABI|_GLIBCXX_RELEASE"
  g++ -v 2>&1 | grep -i configured | tr ' ' '\n' | grep -iE "abi|prefix|version" | head
  python3 -c "import torch, torch._C as C; print(torch.__version__, [(k, getattr(C,k)) for k in dir(C) if 'PYBIND' in k or 'GLIBCXX' in k]); print(torch.__config__.show())" | head -12
  strings -a $(python3 -c "import torch,os;print(os.path.dirname(torch.__file__))")/lib/libc10.so | grep -m3 "GCC: ("
  which cuda-gdb
} > $OUT/diag.txt 2>&1
build() {  # dir, log, extra env
  local dir=$1 log=$2; shift 2
  (cd "$dir" && env "$@" OFFCACHE_FORCE_CUDA=1 MAX_JOBS=16 timeout 150 python3 setup.py build_ext --inplace >"$log" 2>&1) && echo built || echo "BUILD FAILED"
}
# Variant orig: the tree without the explicit ABI define (what ran before); fix: the tree as is;
# sys: the tree built with the system compiler, if it differs from the default one.
rm -rf /tmp/v_orig /tmp/v_sys; cp -r "$ROOT" /tmp/v_orig; cp -r "$ROOT" /tmp/v_sys
sed -i '/_GLIBCXX_USE_CXX11_ABI/d' /tmp/v_orig/setup.py
el "build fix" >>$OUT/diag.txt; build "$ROOT" /tmp/b_fix.log >>$OUT/diag.txt &
el "build orig" >>$OUT/diag.txt; build /tmp/v_orig /tmp/b_orig.log >>$OUT/diag.txt &
if [ -x /usr/bin/g++ ] && [ "$(readlink -f /usr/bin/g++)" != "$(readlink -f "$(which g++)")" ]; then
  el "build sys" >>$OUT/diag.txt; build /tmp/v_sys /tmp/b_sys.log CC=/usr/bin/gcc CXX=/usr/bin/g++ "LDSHARED=/usr/bin/g++ -shared" >>$OUT/diag.txt &
fi
wait
el "builds done" >>$OUT/diag.txt
grep -h "g++ " /tmp/b_fix.log | tail -1 | cut -c1-600 >>$OUT/diag.txt
GOOD=""
for v in orig fix sys; do
  d=$ROOT; [ $v = orig ] && d=/tmp/v_orig; [ $v = sys ] && d=/tmp/v_sys
  ls $d/offcache/_C*.so >/dev/null 2>&1 || { echo "$v: no build" >>$OUT/diag.txt; continue; }
  ok=1
  for c in runtime value value_cuda torch_value; do
    out=$(cd /tmp && PYTHONPATH=$d:/tmp/site-packages timeout 60 python3 $ROOT/benchmarks/diag_repro.py $c 2>&1); rc=$?
    echo "$v $c rc=$rc: $(echo "$out" | grep -E -- "->|NO ERROR|Fatal" | head -2 | tr '\n' ' ')" >>$OUT/diag.txt
    [ "$c" = value ] && [ $rc != 0 ] && ok=0
  done
  [ $ok = 1 ] && [ -z "$GOOD" ] && [ $v != orig ] && GOOD=$d
  if [ $v = orig ] || [ $ok = 0 ]; then
    (cd /tmp && PYTHONPATH=$d:/tmp/site-packages timeout 60 cuda-gdb -q -batch -ex run -ex "bt 40" -ex "info sharedlibrary" --args python3 $ROOT/benchmarks/diag_repro.py value) >/tmp/gdb_$v.txt 2>&1
    grep -E "^#|SIGSEGV|signal" /tmp/gdb_$v.txt | head -60 >$OUT/gdb_$v.txt
    grep -E "libstdc|libgcc|_C\.cpython|libc10\.so" /tmp/gdb_$v.txt | head >>$OUT/gdb_$v.txt
  fi
done
el "repros done; good build: ${GOOD:-none}" >>$OUT/diag.txt
[ -z "$GOOD" ] && GOOD=$ROOT
[ "$GOOD" != "$ROOT" ] && cp $GOOD/offcache/_C*.so $GOOD/offcache/_C_build.json $ROOT/offcache/
export OFFCACHE_EXPECT_CUDA=1
el "gpu tests" >>$OUT/diag.txt
timeout 120 python3 -m pytest -p no:cacheprovider -n 8 -m gpu tests -v --tb=short -rfE -W ignore >$OUT/gpu.log 2>&1
echo "gpu rc=$?" >>$OUT/diag.txt
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/gpu.log | tail -30 >>$OUT/diag.txt
el "bench" >>$OUT/diag.txt
timeout 60 python3 -m offcache.bench transfer overlap small pipeline --quick --out /tmp/bench >$OUT/bench.log 2>&1; echo "bench rc=$?" >>$OUT/diag.txt
el "weights" >>$OUT/diag.txt
timeout 40 python3 -m offcache.bench weights --quick --out /tmp/bench >>$OUT/bench.log 2>&1; echo "weights rc=$?" >>$OUT/diag.txt
el "kv" >>$OUT/diag.txt
timeout 60 python3 -m offcache.bench kv --quick --out /tmp/bench >>$OUT/bench.log 2>&1; echo "kv rc=$?" >>$OUT/diag.txt
el "end" >>$OUT/diag.txt
cp /tmp/bench/results.json $OUT/ 2>/dev/null; cp /tmp/bench/pipeline.png $OUT/ 2>/dev/null
cat $OUT/diag.txt
