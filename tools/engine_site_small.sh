#!/usr/bin/env bash
# Pack vLLM or SGLang for the offline GPU machines (torch 2.11.0+cu130, Python 3.12, no registry) as
# a smaller site than ../shared/gpu/engine_site.sh: only what Hopper and roll's code paths import.
# The site is split into <= 55 MiB chunks that travel one per device call (docs/gpu_checks.md).
#
#   bash tools/engine_site_small.sh sglang     # -> .engines/sglang-small/c0 c1 ...  (from the project root)
#   bash tools/engine_site_small.sh vllm       # -> .engines/vllm-small/c0 ...
#   KEEP_WORK=1 bash tools/engine_site_small.sh sglang   # keep the unpacked site and print its largest files
#
# Versions: the newest releases pinned to torch==2.11.0, vllm 0.24.0 and sglang 0.5.16. What is
# dropped beyond engine_site.sh, and why, is listed per engine below; none of it has run on a GPU.
set -euo pipefail
engine=${1:?usage: tools/engine_site_small.sh vllm|sglang}
here=$(dirname "$(readlink -f "$0")")
top=$(git -C "$here" rev-parse --show-toplevel); cd "$top"
exclude=$(git rev-parse --git-path info/exclude); mkdir -p "$(dirname "$exclude")"
grep -qx '/.engines/' "$exclude" 2>/dev/null || echo '/.engines/' >> "$exclude"
work=$(mktemp -d); out=".engines/$engine-small"; rm -rf "$out"; mkdir -p "$out"
# Dropped for both engines: type stubs, bytecode caches, packages' test suites, static libraries
# (nothing links against them at run time), C/C++ headers of packages that do not JIT-compile here.
common_trim="*.pyi __pycache__ tests test *.a"
case "$engine" in
  # pycountry: mistral_common's extra (its resolution drops extras), which transformers imports when
  # it builds a vision-language processor (Qwen2.5-VL), as vLLM does for a VL model.
  vllm)   root="vllm==0.24.0"; extra="llguidance==1.7.6 apache-tvm-ffi==0.1.11 pycountry==26.2.16"
          # As engine_site.sh: kernels vLLM imports lazily or falls back from (VLLM_USE_FLASHINFER_SAMPLER=0).
          skip="flashinfer-python flashinfer-cubin tilelang nvidia-cudnn-frontend fastsafetensors nvidia-cutlass-dsl quack-kernels tokenspeed-mla tokenspeed-triton humming-kernels"
          # FlashAttention-2 build (Hopper runs FA3), Blackwell FMHA, the Rust frontend roll never starts.
          trim="vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs vllm/third_party/fmha_sm100" ;;
  # SGLang 0.5.16 pins transformers 5.12.1, which needs tokenizers >=0.22.0,<=0.23.0 (0.23.0 itself
  # is not on PyPI, only 0.23.0rc0: engine_site.sh's pin falls back to the newest, 0.23.3, which
  # transformers refuses), and imports dill without declaring it.
  sglang) root="sglang==0.5.16"; extra="apache-tvm-ffi==0.1.11 transformers==5.12.1 tokenizers==0.22.2 dill==0.4.1"
          # As engine_site.sh, plus: tokenspeed-mla/-triton (MLA attention, imported only for
          # DeepSeek-style models; a 290 MB triton fork), flash-attn-4 (Blackwell), nvidia-mathdx and
          # nvidia-cudnn-frontend (FlashInfer's cuDNN/CuTe paths, not the triton/pytorch backends
          # roll starts SGLang with), helion and cuda-tile (kernel DSLs of optional paths), py-spy.
          skip="flashinfer-cubin tilelang nvidia-cutlass-dsl quack-kernels humming-kernels sgl-deep-ep nvshmem4py-cu13 kernels deepseek-recipe tml-renderers smg-grpc-servicer modelscope datasets decord2 av tokenspeed-mla tokenspeed-triton flash-attn-4 nvidia-mathdx nvidia-cudnn-frontend helion cuda-tile py-spy"
          # SGLang's FlashAttention-3 build (attention_backend: triton instead) and Blackwell kernels;
          # SGLang's own test kits.
          trim="sgl_kernel/flash_ops.abi3.so sgl_kernel/sm100 sglang/test" ;;
  *) echo "unknown engine $engine (vllm or sglang)"; exit 2 ;;
esac
cat > "$work/resolve.py" <<'PY'
"""Download ROOT and its requirements (no-deps each), skipping what the GPU image has and SKIP. A
pinned package (ROOT, EXTRA) that cannot be downloaded at its pin is an error, not the newest."""
import glob, os, re, subprocess, sys, zipfile
root, extra, skip, present_file, dest = sys.argv[1:6]
present = set(open(present_file).read().split()) | {"torch", "torchaudio", "torchvision", "torchcodec", "pynvvideocodec", "triton", "numba", "opencv-python-headless", "ninja", "setuptools"}
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
skip = {norm(s) for s in skip.split()}
plat = sum((["--platform", f"manylinux_2_{n}_x86_64"] for n in (17, 24, 27, 28, 31, 34)), []) + ["--platform", "manylinux2014_x86_64", "--platform", "manylinux1_x86_64"]
def get(spec):
    r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
                        "--implementation", "cp", *plat, "-d", dest, spec], capture_output=True, text=True)
    return r.returncode == 0
def reqs(whl):
    with zipfile.ZipFile(whl) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    for line in meta.splitlines():
        if not line.startswith("Requires-Dist:"): continue
        spec = line.split(":", 1)[1].strip(); marker = spec.split(";", 1)[1] if ";" in spec else ""
        if "extra ==" in marker or "win32" in marker or "Windows" in marker or "darwin" in marker or "aarch64\" and" in marker: continue
        if re.search(r'python_version\s*<\s*"3\.(8|9|10|11)"', marker): continue
        name = re.match(r"[A-Za-z0-9_.\-]+", spec).group(0)
        yield norm(name), re.sub(r"\[.*?\]", "", spec.split(";")[0][len(name):]).strip().strip("()")
pinned = [(norm(e.split("==")[0]), "==" + e.split("==")[1]) for e in [root, *extra.split()]]
todo, seen = list(pinned), set()
while todo:
    name, ver = todo.pop(0)
    if name in seen or name in skip or (name in present and (name, ver) not in pinned): continue
    seen.add(name)
    if not get(name + ver.replace(" ", "")):
        if (name, ver) in pinned:
            sys.exit(f"cannot download the pinned {name}{ver}")
        if not get(name):
            print("could not get", name + ver); continue
    whl = [f for f in glob.glob(f"{dest}/*.whl") if norm(os.path.basename(f).split("-")[0]) == name]
    todo += list(reqs(whl[0]))
print(len(seen), "packages")
PY
cp "$here/gpu_image_packages.txt" "$work/present.txt"  # what the GPU image has (one name a line)
python3 "$work/resolve.py" "$root" "$extra" "$skip" "$work/present.txt" "$work/w"
mkdir "$work/site"; for f in "$work"/w/*.whl; do unzip -q -o "$f" -d "$work/site"; done
before=$(du -sm "$work/site" | cut -f1)
(
  cd "$work/site"
  rm -rf $trim
  find . -name '*.cpython-3*-x86_64-linux-gnu.so' ! -name '*cpython-312*' -delete
  for pattern in $common_trim; do
    find . -depth -name "$pattern" ! -path './*.dist-info/*' -exec rm -rf {} +
  done
)
after=$(du -sm "$work/site" | cut -f1)
tar -cf - -C "$work/site" . | xz -T0 -6 > "$work/site.tar.xz"
split -b 55M -d -a 1 "$work/site.tar.xz" "$out/c"
packed=$(du -m "$work/site.tar.xz" | cut -f1)
if [ -n "${KEEP_WORK:-}" ]; then
  echo "site kept in $work/site; largest files:"; find "$work/site" -size +10M -exec du -h {} + | sort -rh | head -15
else
  rm -rf "$work"
fi
n=$(ls "$out" | wc -l)
cat <<MSG
$engine site: ${before} MB unpacked, ${after} MB after trimming, ${packed} MB packed, in $n chunks under $out.
On the GPU machine, in consecutive device calls (each right after the last, so the machine stays
warm), carry one chunk each:
  call k (k = 0..$((n-1))), carry [".engines/$engine-small/ck"]:  mkdir -p /tmp/eng && cp .engines/$engine-small/ck /tmp/eng/
and in the last of them, or any later call while the machine is warm, before the command:
  [ -d /tmp/esite ] || { mkdir -p /tmp/esite && cat /tmp/eng/c* | xz -d -T0 | tar -x -C /tmp/esite; }
  export PYTHONPATH=\$PWD:/tmp/esite VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1
MSG
