#!/bin/bash
# The Vulkan bundle on an NVIDIA GPU through NVIDIA's Vulkan driver, with the
# loader brought as Debian's package (per the device notes the H200 machines may lack libvulkan.so.1; NVIDIA's ICD is
# looked for under /usr/local/nvidia/share/vulkan/icd.d, then the usual places). Not yet run: no device time was left.
# Prepare a carried folder DIR (here, on the build machine) holding:
#   bundle.zip    stoker bundle build --backend vulkan   (the cache entry's bundle.zip)
#   smoke.gguf    python -c "from daemon.bundles.smoke import SmokeSpec; SmokeSpec().write_model(__import__('pathlib').Path('DIR'))"
#   libvulkan1_*.deb vulkan-tools_*.deb   (cd DIR && apt-get download libvulkan1 vulkan-tools)
# then on the GPU machine: bash tests/gpu/vulkan_on_nvidia.sh DIR   (carry DIR). It prints the
# devices, vulkaninfo's summary, the engine's device and offload lines, and the 16 smoke tokens
# next to the ones the bundle recorded (the CPU's, built on a machine without a GPU).
cd "${1:?usage: vulkan_on_nvidia.sh DIR}"
echo "== loader before:"; ldconfig -p | grep -i libvulkan || echo "(no libvulkan on the machine)"
dpkg -x libvulkan1_*.deb /; ldconfig
mkdir -p /tmp/vt && dpkg -x vulkan-tools_*.deb /tmp/vt
for f in /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json /usr/share/vulkan/icd.d/nvidia_icd.json /etc/vulkan/icd.d/nvidia_icd.json; do
  [ -f "$f" ] && { echo "== ICD $f"; cat "$f"; export VK_DRIVER_FILES=$f; break; }
done
nvidia-smi --query-gpu=name,driver_version,memory.free --format=csv
echo "== vulkaninfo --summary"; /tmp/vt/usr/bin/vulkaninfo --summary 2>&1 | sed -n '/Devices:/,$p' | head -30
mkdir -p b && cd b && (unzip -q ../bundle.zip 2>/dev/null || python3 -c "import zipfile;zipfile.ZipFile('../bundle.zip').extractall('.')") && chmod 755 bin/*
echo "== ldd"; ldd bin/libggml-vulkan.so.0 | grep -i -E "vulkan|not found"
echo "== list-devices"; ./bin/llama-server --list-devices 2>&1 | tail -4
./bin/llama-server -m ../smoke.gguf --host 127.0.0.1 --port 18080 -c 256 -np 1 -t 2 --seed 0 --log-colors off > srv.log 2>&1 &
pid=$!
for i in $(seq 1 120); do curl -s -o /dev/null -w '%{http_code}' 127.0.0.1:18080/health | grep -q 200 && break; sleep 0.5; done
echo "== smoke"; curl -s 127.0.0.1:18080/completion -d '{"prompt":"Once upon a time there was a","n_predict":16,"temperature":0,"top_k":1,"seed":0,"cache_prompt":false,"return_tokens":true}' | python3 -c "import json,sys; d=json.load(sys.stdin); print('tokens', d['tokens'])"
python3 -c "import json,zipfile; print('recorded', json.loads(zipfile.ZipFile('../bundle.zip').read('bundle.json'))['smoke']['tokens'])"
kill $pid; wait $pid 2>/dev/null
grep -E "ggml_vulkan|using device|offloaded|Vulkan0|matrix cores" srv.log | head -20
[ -n "${OUT:-}" ] && cp srv.log "$OUT/vulkan-server.log"
