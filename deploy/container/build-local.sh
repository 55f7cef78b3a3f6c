#!/usr/bin/env bash
# Builds the container image of deploy/container/Dockerfile with podman from this
# machine's toolchain and libraries, for where Docker or the base images are out of reach:
#
#   deploy/container/build-local.sh                 # release build, image localhost/quotad:dev
#
# 1. Replays the Dockerfile's build stage: copies exactly the paths its COPY lines name
#    into an empty directory and runs its cargo build there (`cargo build --release
#    --locked`), so a path the Dockerfile forgot fails here as it would in `docker build`.
# 2. Runs deploy/container/rootfs.sh, as the build stage does.
# 3. Builds the runtime stage (FROM scratch) with podman, its `COPY --from=builder` taking
#    the local root instead; prints the image's size.
#
# Environment:
#   TAG=localhost/quotad:dev   the image's name
#   QUOTAD_BINARY=path         skip step 1's cargo build and ship this binary instead (it
#                              still copies the paths and loads the workspace with
#                              `cargo fetch --locked --offline`)
#   WORK=dir                   where the context, root and podman storage go (a temporary
#                              directory by default, removed at exit)
#   EXPORT_TO=dir              also unpack the image's filesystem there (podman create +
#                              export); containers are not started
# Podman runs with vfs storage under $WORK: nothing is left in the machine's own storage.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
DOCKERFILE="$ROOT/deploy/container/Dockerfile"
TAG=${TAG:-localhost/quotad:dev}
if [ -z "${WORK:-}" ]; then
    WORK=$(mktemp -d)
    trap 'rm -rf "$WORK"' EXIT
fi
command -v podman >/dev/null || { echo "needs podman (apt-get install podman)" >&2; exit 1; }
podman() { command podman --root "$WORK/storage" --runroot "$WORK/run" --storage-driver vfs "$@"; }

# 1. The build stage's COPY lines: "COPY src... dst" from the build context.
ctx="$WORK/context"
rm -rf "$ctx" && mkdir -p "$ctx"
stage=$(awk '/^FROM /{n++} n==1' "$DOCKERFILE")
while read -r _ args; do
    # shellcheck disable=SC2086
    set -- $args
    dst=${!#}
    for ((i = 1; i < $#; i++)); do
        src=${!i}
        if [ "$dst" = ./ ]; then to="$ctx/$src"; else to="$ctx/${dst#./}"; fi
        mkdir -p "$(dirname "$to")"
        cp -a "$ROOT/$src" "$to"
    done
done < <(printf '%s\n' "$stage" | grep -E '^COPY ' | grep -v -- '--from=')
(cd "$ctx" && cargo fetch --locked --offline -q --target "$(rustc -vV | sed -n "s/^host: //p")")
if [ -n "${QUOTAD_BINARY:-}" ]; then
    bin=$QUOTAD_BINARY
else
    # Its own target directory, kept between runs, so a second build is incremental.
    revision=$(git -C "$ROOT" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
    (cd "$ctx" && QUOTAD_REVISION=$revision CARGO_TARGET_DIR="$ROOT/target/image" \
        cargo build --release --locked)
    bin="$ROOT/target/image/release/quotad"
fi

# 2. The image's filesystem, as the build stage's last RUN makes it.
image="$WORK/image"
rm -rf "$image" && mkdir -p "$image"
"$ROOT/deploy/container/rootfs.sh" "$bin" "$ctx/config/quotad.toml" "$image/rootfs"

# 3. The runtime stage, its root from step 2.
awk '/^FROM /{n++} n==2' "$DOCKERFILE" |
    sed 's|^COPY --from=builder /rootfs/ /$|COPY rootfs/ /|' > "$image/Containerfile"
grep -q '^COPY rootfs/ /$' "$image/Containerfile" ||
    { echo "the runtime stage no longer copies /rootfs/ from the builder" >&2; exit 1; }
podman build -q --format docker -t "$TAG" -f "$image/Containerfile" "$image" >/dev/null
size=$(podman image inspect --format '{{.Size}}' "$TAG")
echo "image $TAG: $size bytes ($(awk -v s="$size" 'BEGIN { printf "%.1f", s / 1e6 }') MB)"
podman image inspect "$TAG" > "$image/inspect.json"

if [ -n "${EXPORT_TO:-}" ]; then
    mkdir -p "$EXPORT_TO"
    id=$(podman create "$TAG")
    podman export "$id" | tar -x -C "$EXPORT_TO"
    podman rm "$id" >/dev/null 2>&1
fi
