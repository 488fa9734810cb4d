#!/usr/bin/env bash
# Put the official Fashion-MNIST files where `data.root` will point, on the node that runs the
# pipeline driver (the head): from Debian's dataset-fashion-mnist package when it is installed or
# installable, else from the dataset's official download site. Idempotent.
#
#   bash cluster/fetch_fashion_mnist.sh ~/fashion-mnist
#   python pipelines/three_stage.py data.root=$HOME/fashion-mnist ...
set -euo pipefail
dest=${1:?usage: fetch_fashion_mnist.sh DEST_DIR}
files="train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz"
debian=/usr/share/datasets/fashion-mnist
have() { for f in $files; do [ -s "$dest/$f" ] || return 1; done; }

mkdir -p "$dest"
have && exit 0
if [ ! -d "$debian" ] && command -v apt-get >/dev/null; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo -n"
  $sudo apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1 || true
fi
if [ -d "$debian" ]; then
  for f in $files; do cp "$debian/$f" "$dest/$f"; done
else
  python3 - "$dest" $files <<'PY'
import sys, urllib.request
dest, names = sys.argv[1], sys.argv[2:]
for name in names:
    urllib.request.urlretrieve(f"http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/{name}", f"{dest}/{name}")
PY
fi
have || { echo "fetch_fashion_mnist: could not get every file into $dest" >&2; exit 1; }
echo "fetch_fashion_mnist: $dest ready"
