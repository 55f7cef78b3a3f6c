#!/bin/sh
# Assembles the container image's whole filesystem in OUT: the quotad binary, the shared
# libraries it loads (as ldd lists them, at the same paths), a CA bundle (rediss:// without
# tls_ca_file trusts the system roots), a non-root user, name resolution from /etc/hosts
# then DNS, and the config baked in. The Dockerfile runs it in its build stage and copies
# OUT into an empty (FROM scratch) image; tests/image.rs runs it on this machine and
# builds the same image with podman.
#
#   deploy/container/rootfs.sh BINARY CONFIG OUT
#
# CONFIG is config/quotad.toml; inside a container quotad must listen on every interface,
# so its listen line becomes 0.0.0.0:8686, and the result must validate.
set -eu
[ $# -eq 3 ] || { echo "usage: $0 BINARY CONFIG OUT" >&2; exit 2; }
bin=$1 config=$2 out=$3
ca=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
[ -x "$bin" ] || { echo "$0: $bin is not an executable" >&2; exit 1; }
[ -r "$ca" ] || { echo "$0: no CA bundle at $ca (apt-get install ca-certificates)" >&2; exit 1; }

rm -rf "$out"
mkdir -p "$out/usr/local/bin" "$out/etc/quotad" "$out/etc/ssl/certs" "$out/tmp"
chmod 1777 "$out/tmp"
install -m 0755 "$bin" "$out/usr/local/bin/quotad"

# Every library the dynamic loader maps for the binary, and the loader itself: lines are
# "name => /path (addr)" or "/path (addr)"; the vDSO has no file.
ldd "$bin" | awk '{ for (i = 1; i <= NF; i++) if ($i ~ /^\//) { print $i; break } }' |
while read -r lib; do
    mkdir -p "$out$(dirname "$lib")"
    cp -L "$lib" "$out$lib"
done
# Debian keeps the libraries in /lib/x86_64-linux-gnu and /lib64 through the /usr merge's
# symlinks; ldd names them by those paths, so the image has them where the loader looks.

install -m 0644 "$ca" "$out/etc/ssl/certs/ca-certificates.crt"
printf 'root:x:0:0:root:/root:/sbin/nologin\nquotad:x:10001:10001:quotad:/nonexistent:/sbin/nologin\n' \
    > "$out/etc/passwd"
printf 'root:x:0:\nquotad:x:10001:\n' > "$out/etc/group"
# glibc's resolver reads this; the runtime supplies /etc/hosts and /etc/resolv.conf.
printf 'hosts: files dns\n' > "$out/etc/nsswitch.conf"

sed 's/^listen = "127\.0\.0\.1:8686"/listen = "0.0.0.0:8686"/' "$config" > "$out/etc/quotad/quotad.toml"
grep -q '^listen = "0\.0\.0\.0:8686"' "$out/etc/quotad/quotad.toml" ||
    { echo "$0: no 'listen = \"127.0.0.1:8686\"' line in $config" >&2; exit 1; }
chmod 0644 "$out/etc/quotad/quotad.toml"
"$bin" validate "$out/etc/quotad/quotad.toml"
